from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RolloutMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    IDLE: _ClassVar[RolloutMode]
    DEMONSTRATE: _ClassVar[RolloutMode]
    EXPLORE: _ClassVar[RolloutMode]
IDLE: RolloutMode
DEMONSTRATE: RolloutMode
EXPLORE: RolloutMode

class SetModeRequest(_message.Message):
    __slots__ = ("mode", "stage", "task_sets", "group_size", "synchronous", "batch_size", "seed", "tau", "min_version")
    MODE_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    TASK_SETS_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    SYNCHRONOUS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    TAU_FIELD_NUMBER: _ClassVar[int]
    MIN_VERSION_FIELD_NUMBER: _ClassVar[int]
    mode: RolloutMode
    stage: str
    task_sets: _containers.RepeatedScalarFieldContainer[str]
    group_size: int
    synchronous: bool
    batch_size: int
    seed: int
    tau: int
    min_version: int
    def __init__(self, mode: _Optional[_Union[RolloutMode, str]] = ..., stage: _Optional[str] = ..., task_sets: _Optional[_Iterable[str]] = ..., group_size: _Optional[int] = ..., synchronous: _Optional[bool] = ..., batch_size: _Optional[int] = ..., seed: _Optional[int] = ..., tau: _Optional[int] = ..., min_version: _Optional[int] = ...) -> None: ...

class RolloutStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RolloutStatus(_message.Message):
    __slots__ = ("mode", "stage", "policy_version", "episodes", "tokens_generated", "tokens_per_second", "mean_reward", "in_flight", "engine_fingerprint", "shipped", "stopped_stale", "generating", "teacher_seconds", "teacher_tokens", "eval_tasks_done", "eval_tasks")
    MODE_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    EPISODES_FIELD_NUMBER: _ClassVar[int]
    TOKENS_GENERATED_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    MEAN_REWARD_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    SHIPPED_FIELD_NUMBER: _ClassVar[int]
    STOPPED_STALE_FIELD_NUMBER: _ClassVar[int]
    GENERATING_FIELD_NUMBER: _ClassVar[int]
    TEACHER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TEACHER_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EVAL_TASKS_DONE_FIELD_NUMBER: _ClassVar[int]
    EVAL_TASKS_FIELD_NUMBER: _ClassVar[int]
    mode: RolloutMode
    stage: str
    policy_version: int
    episodes: int
    tokens_generated: int
    tokens_per_second: float
    mean_reward: float
    in_flight: int
    engine_fingerprint: str
    shipped: int
    stopped_stale: int
    generating: int
    teacher_seconds: float
    teacher_tokens: int
    eval_tasks_done: int
    eval_tasks: int
    def __init__(self, mode: _Optional[_Union[RolloutMode, str]] = ..., stage: _Optional[str] = ..., policy_version: _Optional[int] = ..., episodes: _Optional[int] = ..., tokens_generated: _Optional[int] = ..., tokens_per_second: _Optional[float] = ..., mean_reward: _Optional[float] = ..., in_flight: _Optional[int] = ..., engine_fingerprint: _Optional[str] = ..., shipped: _Optional[int] = ..., stopped_stale: _Optional[int] = ..., generating: _Optional[int] = ..., teacher_seconds: _Optional[float] = ..., teacher_tokens: _Optional[int] = ..., eval_tasks_done: _Optional[int] = ..., eval_tasks: _Optional[int] = ...) -> None: ...

class TokenSequence(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ScoreRequest(_message.Message):
    __slots__ = ("sequences", "top_k")
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    sequences: _containers.RepeatedCompositeFieldContainer[TokenSequence]
    top_k: int
    def __init__(self, sequences: _Optional[_Iterable[_Union[TokenSequence, _Mapping]]] = ..., top_k: _Optional[int] = ...) -> None: ...

class TokenLogprobs(_message.Message):
    __slots__ = ("logprobs", "topk_ids", "topk_logprobs")
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOPK_IDS_FIELD_NUMBER: _ClassVar[int]
    TOPK_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    topk_ids: _containers.RepeatedScalarFieldContainer[int]
    topk_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, logprobs: _Optional[_Iterable[float]] = ..., topk_ids: _Optional[_Iterable[int]] = ..., topk_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class ScoreResponse(_message.Message):
    __slots__ = ("sequences", "policy_version")
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    sequences: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    policy_version: int
    def __init__(self, sequences: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ..., policy_version: _Optional[int] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("token_ids", "max_tokens", "temperature", "top_p", "stop_token_ids")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_tokens: int
    temperature: float
    top_p: float
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., stop_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("token_ids", "logprobs", "policy_version", "finish_reason")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    policy_version: int
    finish_reason: str
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., policy_version: _Optional[int] = ..., finish_reason: _Optional[str] = ...) -> None: ...

class EvaluateRequest(_message.Message):
    __slots__ = ("task_set", "max_tasks", "samples", "greedy")
    TASK_SET_FIELD_NUMBER: _ClassVar[int]
    MAX_TASKS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    GREEDY_FIELD_NUMBER: _ClassVar[int]
    task_set: str
    max_tasks: int
    samples: int
    greedy: bool
    def __init__(self, task_set: _Optional[str] = ..., max_tasks: _Optional[int] = ..., samples: _Optional[int] = ..., greedy: _Optional[bool] = ...) -> None: ...

class EvaluateResponse(_message.Message):
    __slots__ = ("policy_version", "tasks", "greedy_success", "sampled_success", "seconds", "critical_path_steps", "critical_path_steps_answered", "task_counts")
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    TASKS_FIELD_NUMBER: _ClassVar[int]
    GREEDY_SUCCESS_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_SUCCESS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    CRITICAL_PATH_STEPS_FIELD_NUMBER: _ClassVar[int]
    CRITICAL_PATH_STEPS_ANSWERED_FIELD_NUMBER: _ClassVar[int]
    TASK_COUNTS_FIELD_NUMBER: _ClassVar[int]
    policy_version: int
    tasks: int
    greedy_success: float
    sampled_success: float
    seconds: float
    critical_path_steps: float
    critical_path_steps_answered: float
    task_counts: _containers.RepeatedCompositeFieldContainer[TaskCount]
    def __init__(self, policy_version: _Optional[int] = ..., tasks: _Optional[int] = ..., greedy_success: _Optional[float] = ..., sampled_success: _Optional[float] = ..., seconds: _Optional[float] = ..., critical_path_steps: _Optional[float] = ..., critical_path_steps_answered: _Optional[float] = ..., task_counts: _Optional[_Iterable[_Union[TaskCount, _Mapping]]] = ...) -> None: ...

class TaskCount(_message.Message):
    __slots__ = ("task_id", "samples", "successes", "greedy")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    SUCCESSES_FIELD_NUMBER: _ClassVar[int]
    GREEDY_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    samples: int
    successes: int
    greedy: bool
    def __init__(self, task_id: _Optional[str] = ..., samples: _Optional[int] = ..., successes: _Optional[int] = ..., greedy: _Optional[bool] = ...) -> None: ...
