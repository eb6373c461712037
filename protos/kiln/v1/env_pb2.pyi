from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ListTaskSetsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TaskSetInfo(_message.Message):
    __slots__ = ("name", "env", "size")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    name: str
    env: str
    size: int
    def __init__(self, name: _Optional[str] = ..., env: _Optional[str] = ..., size: _Optional[int] = ...) -> None: ...

class ListTaskSetsResponse(_message.Message):
    __slots__ = ("task_sets",)
    TASK_SETS_FIELD_NUMBER: _ClassVar[int]
    task_sets: _containers.RepeatedCompositeFieldContainer[TaskSetInfo]
    def __init__(self, task_sets: _Optional[_Iterable[_Union[TaskSetInfo, _Mapping]]] = ...) -> None: ...

class OpenEpisodeRequest(_message.Message):
    __slots__ = ("task_set", "index", "owner", "max_actions")
    TASK_SET_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    MAX_ACTIONS_FIELD_NUMBER: _ClassVar[int]
    task_set: str
    index: int
    owner: str
    max_actions: int
    def __init__(self, task_set: _Optional[str] = ..., index: _Optional[int] = ..., owner: _Optional[str] = ..., max_actions: _Optional[int] = ...) -> None: ...

class Episode(_message.Message):
    __slots__ = ("episode_id", "task_id", "env", "prompt", "stop")
    EPISODE_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    episode_id: str
    task_id: str
    env: str
    prompt: str
    stop: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, episode_id: _Optional[str] = ..., task_id: _Optional[str] = ..., env: _Optional[str] = ..., prompt: _Optional[str] = ..., stop: _Optional[_Iterable[str]] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("episode_id", "action")
    EPISODE_ID_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    episode_id: str
    action: str
    def __init__(self, episode_id: _Optional[str] = ..., action: _Optional[str] = ...) -> None: ...

class StepResult(_message.Message):
    __slots__ = ("observation", "done", "reward", "reward_parts", "verifier_output", "flags", "sandbox_image_digest")
    class RewardPartsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    OBSERVATION_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    REWARD_PARTS_FIELD_NUMBER: _ClassVar[int]
    VERIFIER_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    FLAGS_FIELD_NUMBER: _ClassVar[int]
    SANDBOX_IMAGE_DIGEST_FIELD_NUMBER: _ClassVar[int]
    observation: str
    done: bool
    reward: float
    reward_parts: _containers.ScalarMap[str, float]
    verifier_output: str
    flags: _containers.RepeatedScalarFieldContainer[str]
    sandbox_image_digest: str
    def __init__(self, observation: _Optional[str] = ..., done: _Optional[bool] = ..., reward: _Optional[float] = ..., reward_parts: _Optional[_Mapping[str, float]] = ..., verifier_output: _Optional[str] = ..., flags: _Optional[_Iterable[str]] = ..., sandbox_image_digest: _Optional[str] = ...) -> None: ...

class CloseEpisodeRequest(_message.Message):
    __slots__ = ("episode_id",)
    EPISODE_ID_FIELD_NUMBER: _ClassVar[int]
    episode_id: str
    def __init__(self, episode_id: _Optional[str] = ...) -> None: ...

class CloseEpisodeResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DemonstrateRequest(_message.Message):
    __slots__ = ("task_set", "index", "seed")
    TASK_SET_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    task_set: str
    index: int
    seed: int
    def __init__(self, task_set: _Optional[str] = ..., index: _Optional[int] = ..., seed: _Optional[int] = ...) -> None: ...

class Segment(_message.Message):
    __slots__ = ("text", "trained")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TRAINED_FIELD_NUMBER: _ClassVar[int]
    text: str
    trained: bool
    def __init__(self, text: _Optional[str] = ..., trained: _Optional[bool] = ...) -> None: ...

class Demonstration(_message.Message):
    __slots__ = ("task_id", "segments", "reward", "verifier_output")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    VERIFIER_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    segments: _containers.RepeatedCompositeFieldContainer[Segment]
    reward: float
    verifier_output: str
    def __init__(self, task_id: _Optional[str] = ..., segments: _Optional[_Iterable[_Union[Segment, _Mapping]]] = ..., reward: _Optional[float] = ..., verifier_output: _Optional[str] = ...) -> None: ...
