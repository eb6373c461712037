from kiln.protos.kiln.v1 import trajectory_pb2 as _trajectory_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StepKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STEP_KIND_RL: _ClassVar[StepKind]
    STEP_KIND_SFT: _ClassVar[StepKind]
STEP_KIND_RL: StepKind
STEP_KIND_SFT: StepKind

class RunStageRequest(_message.Message):
    __slots__ = ("stage",)
    STAGE_FIELD_NUMBER: _ClassVar[int]
    stage: str
    def __init__(self, stage: _Optional[str] = ...) -> None: ...

class TokenSequence(_message.Message):
    __slots__ = ("id", "tokens")
    ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    id: str
    tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, id: _Optional[str] = ..., tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class LogprobsRequest(_message.Message):
    __slots__ = ("sequences",)
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    sequences: _containers.RepeatedCompositeFieldContainer[TokenSequence]
    def __init__(self, sequences: _Optional[_Iterable[_Union[TokenSequence, _Mapping]]] = ...) -> None: ...

class SequenceLogprobs(_message.Message):
    __slots__ = ("id", "logprobs")
    ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    id: str
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, id: _Optional[str] = ..., logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class LogprobsResponse(_message.Message):
    __slots__ = ("sequences", "policy_version")
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    sequences: _containers.RepeatedCompositeFieldContainer[SequenceLogprobs]
    policy_version: int
    def __init__(self, sequences: _Optional[_Iterable[_Union[SequenceLogprobs, _Mapping]]] = ..., policy_version: _Optional[int] = ...) -> None: ...

class TrainStepRequest(_message.Message):
    __slots__ = ("trajectories", "kind", "stage")
    TRAJECTORIES_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    trajectories: _containers.RepeatedCompositeFieldContainer[_trajectory_pb2.Trajectory]
    kind: StepKind
    stage: str
    def __init__(self, trajectories: _Optional[_Iterable[_Union[_trajectory_pb2.Trajectory, _Mapping]]] = ..., kind: _Optional[_Union[StepKind, str]] = ..., stage: _Optional[str] = ...) -> None: ...

class TrainStepResponse(_message.Message):
    __slots__ = ("step", "policy_version", "metrics")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    STEP_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    step: int
    policy_version: int
    metrics: _containers.ScalarMap[str, float]
    def __init__(self, step: _Optional[int] = ..., policy_version: _Optional[int] = ..., metrics: _Optional[_Mapping[str, float]] = ...) -> None: ...

class NewVersionRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

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

class SaveCheckpointRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SaveCheckpointResponse(_message.Message):
    __slots__ = ("path", "step")
    PATH_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    path: str
    step: int
    def __init__(self, path: _Optional[str] = ..., step: _Optional[int] = ...) -> None: ...
