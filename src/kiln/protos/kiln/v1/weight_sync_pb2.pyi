from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TensorEntry(_message.Message):
    __slots__ = ("name", "shape", "dtype", "offset", "nbytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    offset: int
    nbytes: int
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., offset: _Optional[int] = ..., nbytes: _Optional[int] = ...) -> None: ...

class Manifest(_message.Message):
    __slots__ = ("policy_version", "tensors", "total_bytes", "bucket_bytes", "num_buckets", "digest_algorithm", "digest")
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    BUCKET_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_BUCKETS_FIELD_NUMBER: _ClassVar[int]
    DIGEST_ALGORITHM_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    policy_version: int
    tensors: _containers.RepeatedCompositeFieldContainer[TensorEntry]
    total_bytes: int
    bucket_bytes: int
    num_buckets: int
    digest_algorithm: str
    digest: bytes
    def __init__(self, policy_version: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[TensorEntry, _Mapping]]] = ..., total_bytes: _Optional[int] = ..., bucket_bytes: _Optional[int] = ..., num_buckets: _Optional[int] = ..., digest_algorithm: _Optional[str] = ..., digest: _Optional[bytes] = ...) -> None: ...

class Bucket(_message.Message):
    __slots__ = ("policy_version", "index", "data", "digest")
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    policy_version: int
    index: int
    data: bytes
    digest: bytes
    def __init__(self, policy_version: _Optional[int] = ..., index: _Optional[int] = ..., data: _Optional[bytes] = ..., digest: _Optional[bytes] = ...) -> None: ...

class WeightChunk(_message.Message):
    __slots__ = ("manifest", "bucket")
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    BUCKET_FIELD_NUMBER: _ClassVar[int]
    manifest: Manifest
    bucket: Bucket
    def __init__(self, manifest: _Optional[_Union[Manifest, _Mapping]] = ..., bucket: _Optional[_Union[Bucket, _Mapping]] = ...) -> None: ...

class PublishReply(_message.Message):
    __slots__ = ("policy_version", "bytes", "seconds")
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    policy_version: int
    bytes: int
    seconds: float
    def __init__(self, policy_version: _Optional[int] = ..., bytes: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class SubscribeRequest(_message.Message):
    __slots__ = ("replica_id", "stream_index", "num_streams", "applied_policy_version")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    STREAM_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_STREAMS_FIELD_NUMBER: _ClassVar[int]
    APPLIED_POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    stream_index: int
    num_streams: int
    applied_policy_version: int
    def __init__(self, replica_id: _Optional[str] = ..., stream_index: _Optional[int] = ..., num_streams: _Optional[int] = ..., applied_policy_version: _Optional[int] = ...) -> None: ...

class AckRequest(_message.Message):
    __slots__ = ("replica_id", "policy_version", "ok", "error")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    policy_version: int
    ok: bool
    error: str
    def __init__(self, replica_id: _Optional[str] = ..., policy_version: _Optional[int] = ..., ok: _Optional[bool] = ..., error: _Optional[str] = ...) -> None: ...

class AckReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReplicaState(_message.Message):
    __slots__ = ("replica_id", "applied_policy_version", "last_policy_version", "last_ok", "last_error")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    APPLIED_POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    LAST_POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    LAST_OK_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    applied_policy_version: int
    last_policy_version: int
    last_ok: bool
    last_error: str
    def __init__(self, replica_id: _Optional[str] = ..., applied_policy_version: _Optional[int] = ..., last_policy_version: _Optional[int] = ..., last_ok: _Optional[bool] = ..., last_error: _Optional[str] = ...) -> None: ...

class StatusReply(_message.Message):
    __slots__ = ("policy_version", "replicas")
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    policy_version: int
    replicas: _containers.RepeatedCompositeFieldContainer[ReplicaState]
    def __init__(self, policy_version: _Optional[int] = ..., replicas: _Optional[_Iterable[_Union[ReplicaState, _Mapping]]] = ...) -> None: ...
