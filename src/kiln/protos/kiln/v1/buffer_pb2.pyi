from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class AckStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ACK_STATUS_UNSPECIFIED: _ClassVar[AckStatus]
    ACK_STATUS_ACKED: _ClassVar[AckStatus]
    ACK_STATUS_ALREADY_ACKED: _ClassVar[AckStatus]
    ACK_STATUS_UNKNOWN: _ClassVar[AckStatus]
    ACK_STATUS_RELEASED: _ClassVar[AckStatus]
ACK_STATUS_UNSPECIFIED: AckStatus
ACK_STATUS_ACKED: AckStatus
ACK_STATUS_ALREADY_ACKED: AckStatus
ACK_STATUS_UNKNOWN: AckStatus
ACK_STATUS_RELEASED: AckStatus

class PutRequest(_message.Message):
    __slots__ = ("trajectories", "group_size")
    TRAJECTORIES_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    trajectories: _containers.RepeatedScalarFieldContainer[bytes]
    group_size: int
    def __init__(self, trajectories: _Optional[_Iterable[bytes]] = ..., group_size: _Optional[int] = ...) -> None: ...

class PutResponse(_message.Message):
    __slots__ = ("accepted", "duplicates", "dropped_stale", "depth")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    DUPLICATES_FIELD_NUMBER: _ClassVar[int]
    DROPPED_STALE_FIELD_NUMBER: _ClassVar[int]
    DEPTH_FIELD_NUMBER: _ClassVar[int]
    accepted: int
    duplicates: int
    dropped_stale: int
    depth: int
    def __init__(self, accepted: _Optional[int] = ..., duplicates: _Optional[int] = ..., dropped_stale: _Optional[int] = ..., depth: _Optional[int] = ...) -> None: ...

class GetBatchRequest(_message.Message):
    __slots__ = ("size", "policy_version", "timeout_seconds", "allow_partial")
    SIZE_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ALLOW_PARTIAL_FIELD_NUMBER: _ClassVar[int]
    size: int
    policy_version: int
    timeout_seconds: float
    allow_partial: bool
    def __init__(self, size: _Optional[int] = ..., policy_version: _Optional[int] = ..., timeout_seconds: _Optional[float] = ..., allow_partial: _Optional[bool] = ...) -> None: ...

class Batch(_message.Message):
    __slots__ = ("trajectories", "batch_id", "policy_version", "staleness", "delivery")
    TRAJECTORIES_FIELD_NUMBER: _ClassVar[int]
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    STALENESS_FIELD_NUMBER: _ClassVar[int]
    DELIVERY_FIELD_NUMBER: _ClassVar[int]
    trajectories: _containers.RepeatedScalarFieldContainer[bytes]
    batch_id: int
    policy_version: int
    staleness: _containers.RepeatedScalarFieldContainer[int]
    delivery: int
    def __init__(self, trajectories: _Optional[_Iterable[bytes]] = ..., batch_id: _Optional[int] = ..., policy_version: _Optional[int] = ..., staleness: _Optional[_Iterable[int]] = ..., delivery: _Optional[int] = ...) -> None: ...

class AckBatchRequest(_message.Message):
    __slots__ = ("batch_id",)
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    batch_id: int
    def __init__(self, batch_id: _Optional[int] = ...) -> None: ...

class AckBatchResponse(_message.Message):
    __slots__ = ("status", "trajectories", "detail")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    TRAJECTORIES_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    status: AckStatus
    trajectories: int
    detail: str
    def __init__(self, status: _Optional[_Union[AckStatus, str]] = ..., trajectories: _Optional[int] = ..., detail: _Optional[str] = ...) -> None: ...

class SetPolicyVersionRequest(_message.Message):
    __slots__ = ("policy_version",)
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    policy_version: int
    def __init__(self, policy_version: _Optional[int] = ...) -> None: ...

class ConfigureRequest(_message.Message):
    __slots__ = ("group_size", "tau", "drop_unserved")
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    TAU_FIELD_NUMBER: _ClassVar[int]
    DROP_UNSERVED_FIELD_NUMBER: _ClassVar[int]
    group_size: int
    tau: int
    drop_unserved: bool
    def __init__(self, group_size: _Optional[int] = ..., tau: _Optional[int] = ..., drop_unserved: _Optional[bool] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class BufferStatus(_message.Message):
    __slots__ = ("depth", "ready", "groups_pending", "groups_ready", "accepted", "served", "dropped_stale", "dropped_other", "batches", "max_staleness", "policy_version", "capacity", "group_size", "tau", "leased", "leases", "batches_acked", "redeliveries", "lease_timeout", "unconsumed_bytes", "capacity_bytes")
    DEPTH_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    GROUPS_PENDING_FIELD_NUMBER: _ClassVar[int]
    GROUPS_READY_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    SERVED_FIELD_NUMBER: _ClassVar[int]
    DROPPED_STALE_FIELD_NUMBER: _ClassVar[int]
    DROPPED_OTHER_FIELD_NUMBER: _ClassVar[int]
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    MAX_STALENESS_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    TAU_FIELD_NUMBER: _ClassVar[int]
    LEASED_FIELD_NUMBER: _ClassVar[int]
    LEASES_FIELD_NUMBER: _ClassVar[int]
    BATCHES_ACKED_FIELD_NUMBER: _ClassVar[int]
    REDELIVERIES_FIELD_NUMBER: _ClassVar[int]
    LEASE_TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    UNCONSUMED_BYTES_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    depth: int
    ready: int
    groups_pending: int
    groups_ready: int
    accepted: int
    served: int
    dropped_stale: int
    dropped_other: int
    batches: int
    max_staleness: int
    policy_version: int
    capacity: int
    group_size: int
    tau: int
    leased: int
    leases: int
    batches_acked: int
    redeliveries: int
    lease_timeout: float
    unconsumed_bytes: int
    capacity_bytes: int
    def __init__(self, depth: _Optional[int] = ..., ready: _Optional[int] = ..., groups_pending: _Optional[int] = ..., groups_ready: _Optional[int] = ..., accepted: _Optional[int] = ..., served: _Optional[int] = ..., dropped_stale: _Optional[int] = ..., dropped_other: _Optional[int] = ..., batches: _Optional[int] = ..., max_staleness: _Optional[int] = ..., policy_version: _Optional[int] = ..., capacity: _Optional[int] = ..., group_size: _Optional[int] = ..., tau: _Optional[int] = ..., leased: _Optional[int] = ..., leases: _Optional[int] = ..., batches_acked: _Optional[int] = ..., redeliveries: _Optional[int] = ..., lease_timeout: _Optional[float] = ..., unconsumed_bytes: _Optional[int] = ..., capacity_bytes: _Optional[int] = ...) -> None: ...

class BufferRecord(_message.Message):
    __slots__ = ("trajectory", "group_size", "id")
    TRAJECTORY_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    trajectory: bytes
    group_size: int
    id: str
    def __init__(self, trajectory: _Optional[bytes] = ..., group_size: _Optional[int] = ..., id: _Optional[str] = ...) -> None: ...
