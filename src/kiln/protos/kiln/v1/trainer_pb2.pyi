from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class FetchStageExportRequest(_message.Message):
    __slots__ = ("stage",)
    STAGE_FIELD_NUMBER: _ClassVar[int]
    stage: str
    def __init__(self, stage: _Optional[str] = ...) -> None: ...

class ExportChunk(_message.Message):
    __slots__ = ("path", "data", "size", "sha256")
    PATH_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    path: str
    data: bytes
    size: int
    sha256: str
    def __init__(self, path: _Optional[str] = ..., data: _Optional[bytes] = ..., size: _Optional[int] = ..., sha256: _Optional[str] = ...) -> None: ...

class RunStageRequest(_message.Message):
    __slots__ = ("stage",)
    STAGE_FIELD_NUMBER: _ClassVar[int]
    stage: str
    def __init__(self, stage: _Optional[str] = ...) -> None: ...

class TrainerStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TrainerStatus(_message.Message):
    __slots__ = ("step", "policy_version", "stage", "last_metrics", "last_checkpoint", "tensor_parallel", "model_dir", "stage_step", "stage_max_steps", "stage_done", "stage_failed", "message")
    class LastMetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    STEP_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    LAST_METRICS_FIELD_NUMBER: _ClassVar[int]
    LAST_CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_FIELD_NUMBER: _ClassVar[int]
    MODEL_DIR_FIELD_NUMBER: _ClassVar[int]
    STAGE_STEP_FIELD_NUMBER: _ClassVar[int]
    STAGE_MAX_STEPS_FIELD_NUMBER: _ClassVar[int]
    STAGE_DONE_FIELD_NUMBER: _ClassVar[int]
    STAGE_FAILED_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    step: int
    policy_version: int
    stage: str
    last_metrics: _containers.ScalarMap[str, float]
    last_checkpoint: str
    tensor_parallel: int
    model_dir: str
    stage_step: int
    stage_max_steps: int
    stage_done: bool
    stage_failed: bool
    message: str
    def __init__(self, step: _Optional[int] = ..., policy_version: _Optional[int] = ..., stage: _Optional[str] = ..., last_metrics: _Optional[_Mapping[str, float]] = ..., last_checkpoint: _Optional[str] = ..., tensor_parallel: _Optional[int] = ..., model_dir: _Optional[str] = ..., stage_step: _Optional[int] = ..., stage_max_steps: _Optional[int] = ..., stage_done: _Optional[bool] = ..., stage_failed: _Optional[bool] = ..., message: _Optional[str] = ...) -> None: ...
