from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RecordScalarsRequest(_message.Message):
    __slots__ = ("step", "scalars")
    class ScalarsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    STEP_FIELD_NUMBER: _ClassVar[int]
    SCALARS_FIELD_NUMBER: _ClassVar[int]
    step: int
    scalars: _containers.ScalarMap[str, float]
    def __init__(self, step: _Optional[int] = ..., scalars: _Optional[_Mapping[str, float]] = ...) -> None: ...

class RecordScalarsReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ContinueStageRequest(_message.Message):
    __slots__ = ("stage", "step", "keep_step")
    STAGE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    KEEP_STEP_FIELD_NUMBER: _ClassVar[int]
    stage: str
    step: int
    keep_step: int
    def __init__(self, stage: _Optional[str] = ..., step: _Optional[int] = ..., keep_step: _Optional[int] = ...) -> None: ...

class RestoreCheckpointRequest(_message.Message):
    __slots__ = ("stage", "step", "reason")
    STAGE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    stage: str
    step: int
    reason: str
    def __init__(self, stage: _Optional[str] = ..., step: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

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

class StepMetrics(_message.Message):
    __slots__ = ("step", "policy_version", "loss", "grad_norm", "lr", "sequences", "tokens", "step_seconds", "tokens_per_second", "wait_seconds", "reward_mean", "ratio_mask_frac", "icepop_mask_frac", "ratio_only_frac", "icepop_only_frac", "both_masked_frac", "kept_frac", "ratio_mean", "mismatch_abs", "mismatch_kl", "kl_ref", "dense_kl", "routing_flip_frac", "staleness", "correction_mask_frac", "correction_weight_mean", "routing_straddle_frac")
    class StalenessEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: int
        def __init__(self, key: _Optional[int] = ..., value: _Optional[int] = ...) -> None: ...
    STEP_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    GRAD_NORM_FIELD_NUMBER: _ClassVar[int]
    LR_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    REWARD_MEAN_FIELD_NUMBER: _ClassVar[int]
    RATIO_MASK_FRAC_FIELD_NUMBER: _ClassVar[int]
    ICEPOP_MASK_FRAC_FIELD_NUMBER: _ClassVar[int]
    RATIO_ONLY_FRAC_FIELD_NUMBER: _ClassVar[int]
    ICEPOP_ONLY_FRAC_FIELD_NUMBER: _ClassVar[int]
    BOTH_MASKED_FRAC_FIELD_NUMBER: _ClassVar[int]
    KEPT_FRAC_FIELD_NUMBER: _ClassVar[int]
    RATIO_MEAN_FIELD_NUMBER: _ClassVar[int]
    MISMATCH_ABS_FIELD_NUMBER: _ClassVar[int]
    MISMATCH_KL_FIELD_NUMBER: _ClassVar[int]
    KL_REF_FIELD_NUMBER: _ClassVar[int]
    DENSE_KL_FIELD_NUMBER: _ClassVar[int]
    ROUTING_FLIP_FRAC_FIELD_NUMBER: _ClassVar[int]
    STALENESS_FIELD_NUMBER: _ClassVar[int]
    CORRECTION_MASK_FRAC_FIELD_NUMBER: _ClassVar[int]
    CORRECTION_WEIGHT_MEAN_FIELD_NUMBER: _ClassVar[int]
    ROUTING_STRADDLE_FRAC_FIELD_NUMBER: _ClassVar[int]
    step: int
    policy_version: int
    loss: float
    grad_norm: float
    lr: float
    sequences: int
    tokens: int
    step_seconds: float
    tokens_per_second: float
    wait_seconds: float
    reward_mean: float
    ratio_mask_frac: float
    icepop_mask_frac: float
    ratio_only_frac: float
    icepop_only_frac: float
    both_masked_frac: float
    kept_frac: float
    ratio_mean: float
    mismatch_abs: float
    mismatch_kl: float
    kl_ref: float
    dense_kl: float
    routing_flip_frac: float
    staleness: _containers.ScalarMap[int, int]
    correction_mask_frac: float
    correction_weight_mean: float
    routing_straddle_frac: float
    def __init__(self, step: _Optional[int] = ..., policy_version: _Optional[int] = ..., loss: _Optional[float] = ..., grad_norm: _Optional[float] = ..., lr: _Optional[float] = ..., sequences: _Optional[int] = ..., tokens: _Optional[int] = ..., step_seconds: _Optional[float] = ..., tokens_per_second: _Optional[float] = ..., wait_seconds: _Optional[float] = ..., reward_mean: _Optional[float] = ..., ratio_mask_frac: _Optional[float] = ..., icepop_mask_frac: _Optional[float] = ..., ratio_only_frac: _Optional[float] = ..., icepop_only_frac: _Optional[float] = ..., both_masked_frac: _Optional[float] = ..., kept_frac: _Optional[float] = ..., ratio_mean: _Optional[float] = ..., mismatch_abs: _Optional[float] = ..., mismatch_kl: _Optional[float] = ..., kl_ref: _Optional[float] = ..., dense_kl: _Optional[float] = ..., routing_flip_frac: _Optional[float] = ..., staleness: _Optional[_Mapping[int, int]] = ..., correction_mask_frac: _Optional[float] = ..., correction_weight_mean: _Optional[float] = ..., routing_straddle_frac: _Optional[float] = ...) -> None: ...

class TrainerStatus(_message.Message):
    __slots__ = ("step", "policy_version", "stage", "last_step", "last_checkpoint", "tensor_parallel", "model_dir", "stage_step", "stage_max_steps", "stage_done", "stage_failed", "message", "stage_eval_step", "stage_selected_step", "stage_selected_reason")
    STEP_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_FIELD_NUMBER: _ClassVar[int]
    LAST_CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_FIELD_NUMBER: _ClassVar[int]
    MODEL_DIR_FIELD_NUMBER: _ClassVar[int]
    STAGE_STEP_FIELD_NUMBER: _ClassVar[int]
    STAGE_MAX_STEPS_FIELD_NUMBER: _ClassVar[int]
    STAGE_DONE_FIELD_NUMBER: _ClassVar[int]
    STAGE_FAILED_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    STAGE_EVAL_STEP_FIELD_NUMBER: _ClassVar[int]
    STAGE_SELECTED_STEP_FIELD_NUMBER: _ClassVar[int]
    STAGE_SELECTED_REASON_FIELD_NUMBER: _ClassVar[int]
    step: int
    policy_version: int
    stage: str
    last_step: StepMetrics
    last_checkpoint: str
    tensor_parallel: int
    model_dir: str
    stage_step: int
    stage_max_steps: int
    stage_done: bool
    stage_failed: bool
    message: str
    stage_eval_step: int
    stage_selected_step: int
    stage_selected_reason: str
    def __init__(self, step: _Optional[int] = ..., policy_version: _Optional[int] = ..., stage: _Optional[str] = ..., last_step: _Optional[_Union[StepMetrics, _Mapping]] = ..., last_checkpoint: _Optional[str] = ..., tensor_parallel: _Optional[int] = ..., model_dir: _Optional[str] = ..., stage_step: _Optional[int] = ..., stage_max_steps: _Optional[int] = ..., stage_done: _Optional[bool] = ..., stage_failed: _Optional[bool] = ..., message: _Optional[str] = ..., stage_eval_step: _Optional[int] = ..., stage_selected_step: _Optional[int] = ..., stage_selected_reason: _Optional[str] = ...) -> None: ...
