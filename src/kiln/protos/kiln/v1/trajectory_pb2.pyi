from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RoutedExperts(_message.Message):
    __slots__ = ("layers", "topk", "num_experts", "start", "rows", "packed", "version_starts", "versions")
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    TOPK_FIELD_NUMBER: _ClassVar[int]
    NUM_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    PACKED_FIELD_NUMBER: _ClassVar[int]
    VERSION_STARTS_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    layers: int
    topk: int
    num_experts: int
    start: int
    rows: int
    packed: bytes
    version_starts: _containers.RepeatedScalarFieldContainer[int]
    versions: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, layers: _Optional[int] = ..., topk: _Optional[int] = ..., num_experts: _Optional[int] = ..., start: _Optional[int] = ..., rows: _Optional[int] = ..., packed: _Optional[bytes] = ..., version_starts: _Optional[_Iterable[int]] = ..., versions: _Optional[_Iterable[int]] = ...) -> None: ...

class ToolChoice(_message.Message):
    __slots__ = ("positions", "token_ids", "counts", "temperatures")
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURES_FIELD_NUMBER: _ClassVar[int]
    positions: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    counts: _containers.RepeatedScalarFieldContainer[int]
    temperatures: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, positions: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ..., counts: _Optional[_Iterable[int]] = ..., temperatures: _Optional[_Iterable[float]] = ...) -> None: ...

class VersionSpan(_message.Message):
    __slots__ = ("start", "end", "policy_version")
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    start: int
    end: int
    policy_version: int
    def __init__(self, start: _Optional[int] = ..., end: _Optional[int] = ..., policy_version: _Optional[int] = ...) -> None: ...

class Trajectory(_message.Message):
    __slots__ = ("id", "task_id", "group_id", "env", "tokens", "loss_mask", "logp_infer", "version_spans", "prompt_len", "teacher_logp", "teacher_top_k", "teacher_topk_ids", "teacher_topk_logp", "reward", "reward_parts", "verifier_output", "flags", "shaping_reward", "shaping_mask", "sandbox_image_digest", "engine_fingerprint", "index_hashes", "routed_experts", "tool_choice", "created_at")
    class RewardPartsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    ID_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOSS_MASK_FIELD_NUMBER: _ClassVar[int]
    LOGP_INFER_FIELD_NUMBER: _ClassVar[int]
    VERSION_SPANS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LEN_FIELD_NUMBER: _ClassVar[int]
    TEACHER_LOGP_FIELD_NUMBER: _ClassVar[int]
    TEACHER_TOP_K_FIELD_NUMBER: _ClassVar[int]
    TEACHER_TOPK_IDS_FIELD_NUMBER: _ClassVar[int]
    TEACHER_TOPK_LOGP_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    REWARD_PARTS_FIELD_NUMBER: _ClassVar[int]
    VERIFIER_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    FLAGS_FIELD_NUMBER: _ClassVar[int]
    SHAPING_REWARD_FIELD_NUMBER: _ClassVar[int]
    SHAPING_MASK_FIELD_NUMBER: _ClassVar[int]
    SANDBOX_IMAGE_DIGEST_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    INDEX_HASHES_FIELD_NUMBER: _ClassVar[int]
    ROUTED_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CHOICE_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    id: str
    task_id: str
    group_id: str
    env: str
    tokens: _containers.RepeatedScalarFieldContainer[int]
    loss_mask: _containers.RepeatedScalarFieldContainer[int]
    logp_infer: _containers.RepeatedScalarFieldContainer[float]
    version_spans: _containers.RepeatedCompositeFieldContainer[VersionSpan]
    prompt_len: int
    teacher_logp: _containers.RepeatedScalarFieldContainer[float]
    teacher_top_k: int
    teacher_topk_ids: _containers.RepeatedScalarFieldContainer[int]
    teacher_topk_logp: _containers.RepeatedScalarFieldContainer[float]
    reward: float
    reward_parts: _containers.ScalarMap[str, float]
    verifier_output: str
    flags: _containers.RepeatedScalarFieldContainer[str]
    shaping_reward: float
    shaping_mask: _containers.RepeatedScalarFieldContainer[int]
    sandbox_image_digest: str
    engine_fingerprint: str
    index_hashes: _containers.RepeatedScalarFieldContainer[int]
    routed_experts: RoutedExperts
    tool_choice: ToolChoice
    created_at: float
    def __init__(self, id: _Optional[str] = ..., task_id: _Optional[str] = ..., group_id: _Optional[str] = ..., env: _Optional[str] = ..., tokens: _Optional[_Iterable[int]] = ..., loss_mask: _Optional[_Iterable[int]] = ..., logp_infer: _Optional[_Iterable[float]] = ..., version_spans: _Optional[_Iterable[_Union[VersionSpan, _Mapping]]] = ..., prompt_len: _Optional[int] = ..., teacher_logp: _Optional[_Iterable[float]] = ..., teacher_top_k: _Optional[int] = ..., teacher_topk_ids: _Optional[_Iterable[int]] = ..., teacher_topk_logp: _Optional[_Iterable[float]] = ..., reward: _Optional[float] = ..., reward_parts: _Optional[_Mapping[str, float]] = ..., verifier_output: _Optional[str] = ..., flags: _Optional[_Iterable[str]] = ..., shaping_reward: _Optional[float] = ..., shaping_mask: _Optional[_Iterable[int]] = ..., sandbox_image_digest: _Optional[str] = ..., engine_fingerprint: _Optional[str] = ..., index_hashes: _Optional[_Iterable[int]] = ..., routed_experts: _Optional[_Union[RoutedExperts, _Mapping]] = ..., tool_choice: _Optional[_Union[ToolChoice, _Mapping]] = ..., created_at: _Optional[float] = ...) -> None: ...
