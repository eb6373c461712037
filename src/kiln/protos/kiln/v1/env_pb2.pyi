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

class OpenSubtaskRequest(_message.Message):
    __slots__ = ("parent_episode_id", "role", "instructions", "task", "owner", "max_actions")
    PARENT_EPISODE_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    INSTRUCTIONS_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    MAX_ACTIONS_FIELD_NUMBER: _ClassVar[int]
    parent_episode_id: str
    role: str
    instructions: str
    task: str
    owner: str
    max_actions: int
    def __init__(self, parent_episode_id: _Optional[str] = ..., role: _Optional[str] = ..., instructions: _Optional[str] = ..., task: _Optional[str] = ..., owner: _Optional[str] = ..., max_actions: _Optional[int] = ...) -> None: ...

class Message(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class ToolSpec(_message.Message):
    __slots__ = ("name", "description", "parameters_json")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_JSON_FIELD_NUMBER: _ClassVar[int]
    name: str
    description: str
    parameters_json: str
    def __init__(self, name: _Optional[str] = ..., description: _Optional[str] = ..., parameters_json: _Optional[str] = ...) -> None: ...

class Episode(_message.Message):
    __slots__ = ("episode_id", "task_id", "env", "messages", "tools")
    EPISODE_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    episode_id: str
    task_id: str
    env: str
    messages: _containers.RepeatedCompositeFieldContainer[Message]
    tools: _containers.RepeatedCompositeFieldContainer[ToolSpec]
    def __init__(self, episode_id: _Optional[str] = ..., task_id: _Optional[str] = ..., env: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[Message, _Mapping]]] = ..., tools: _Optional[_Iterable[_Union[ToolSpec, _Mapping]]] = ...) -> None: ...

class ToolCall(_message.Message):
    __slots__ = ("id", "name", "arguments_json")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_JSON_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    arguments_json: str
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., arguments_json: _Optional[str] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("episode_id", "tool_calls", "content", "unparseable", "problem")
    EPISODE_ID_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    UNPARSEABLE_FIELD_NUMBER: _ClassVar[int]
    PROBLEM_FIELD_NUMBER: _ClassVar[int]
    episode_id: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    content: str
    unparseable: bool
    problem: str
    def __init__(self, episode_id: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ..., content: _Optional[str] = ..., unparseable: _Optional[bool] = ..., problem: _Optional[str] = ...) -> None: ...

class ToolOutput(_message.Message):
    __slots__ = ("tool_call_id", "name", "content")
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    tool_call_id: str
    name: str
    content: str
    def __init__(self, tool_call_id: _Optional[str] = ..., name: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class StepResult(_message.Message):
    __slots__ = ("outputs", "done", "reward", "reward_parts", "verifier_output", "flags", "sandbox_image_digest", "answer", "reference", "tools")
    class RewardPartsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    REWARD_PARTS_FIELD_NUMBER: _ClassVar[int]
    VERIFIER_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    FLAGS_FIELD_NUMBER: _ClassVar[int]
    SANDBOX_IMAGE_DIGEST_FIELD_NUMBER: _ClassVar[int]
    ANSWER_FIELD_NUMBER: _ClassVar[int]
    REFERENCE_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    outputs: _containers.RepeatedCompositeFieldContainer[ToolOutput]
    done: bool
    reward: float
    reward_parts: _containers.ScalarMap[str, float]
    verifier_output: str
    flags: _containers.RepeatedScalarFieldContainer[str]
    sandbox_image_digest: str
    answer: str
    reference: str
    tools: ToolNames
    def __init__(self, outputs: _Optional[_Iterable[_Union[ToolOutput, _Mapping]]] = ..., done: _Optional[bool] = ..., reward: _Optional[float] = ..., reward_parts: _Optional[_Mapping[str, float]] = ..., verifier_output: _Optional[str] = ..., flags: _Optional[_Iterable[str]] = ..., sandbox_image_digest: _Optional[str] = ..., answer: _Optional[str] = ..., reference: _Optional[str] = ..., tools: _Optional[_Union[ToolNames, _Mapping]] = ...) -> None: ...

class ToolNames(_message.Message):
    __slots__ = ("names",)
    NAMES_FIELD_NUMBER: _ClassVar[int]
    names: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, names: _Optional[_Iterable[str]] = ...) -> None: ...

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

class DemoTurn(_message.Message):
    __slots__ = ("content", "tool_calls", "outputs")
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    content: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    outputs: _containers.RepeatedCompositeFieldContainer[ToolOutput]
    def __init__(self, content: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ..., outputs: _Optional[_Iterable[_Union[ToolOutput, _Mapping]]] = ...) -> None: ...

class Demonstration(_message.Message):
    __slots__ = ("task_id", "messages", "tools", "turns", "reward", "verifier_output")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    TURNS_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    VERIFIER_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    messages: _containers.RepeatedCompositeFieldContainer[Message]
    tools: _containers.RepeatedCompositeFieldContainer[ToolSpec]
    turns: _containers.RepeatedCompositeFieldContainer[DemoTurn]
    reward: float
    verifier_output: str
    def __init__(self, task_id: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[Message, _Mapping]]] = ..., tools: _Optional[_Iterable[_Union[ToolSpec, _Mapping]]] = ..., turns: _Optional[_Iterable[_Union[DemoTurn, _Mapping]]] = ..., reward: _Optional[float] = ..., verifier_output: _Optional[str] = ...) -> None: ...
