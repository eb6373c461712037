from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Limits(_message.Message):
    __slots__ = ("memory_bytes", "pids", "cpu", "timeout_seconds", "network", "output_limit_bytes", "disk_bytes")
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    PIDS_FIELD_NUMBER: _ClassVar[int]
    CPU_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    NETWORK_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_LIMIT_BYTES_FIELD_NUMBER: _ClassVar[int]
    DISK_BYTES_FIELD_NUMBER: _ClassVar[int]
    memory_bytes: int
    pids: int
    cpu: float
    timeout_seconds: float
    network: bool
    output_limit_bytes: int
    disk_bytes: int
    def __init__(self, memory_bytes: _Optional[int] = ..., pids: _Optional[int] = ..., cpu: _Optional[float] = ..., timeout_seconds: _Optional[float] = ..., network: _Optional[bool] = ..., output_limit_bytes: _Optional[int] = ..., disk_bytes: _Optional[int] = ...) -> None: ...

class CreateSessionRequest(_message.Message):
    __slots__ = ("owner", "image", "limits", "ttl_seconds", "task_json")
    OWNER_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TASK_JSON_FIELD_NUMBER: _ClassVar[int]
    owner: str
    image: str
    limits: Limits
    ttl_seconds: float
    task_json: str
    def __init__(self, owner: _Optional[str] = ..., image: _Optional[str] = ..., limits: _Optional[_Union[Limits, _Mapping]] = ..., ttl_seconds: _Optional[float] = ..., task_json: _Optional[str] = ...) -> None: ...

class SessionInfo(_message.Message):
    __slots__ = ("session_id", "sandbox_name", "task_id")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SANDBOX_NAME_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    sandbox_name: str
    task_id: str
    def __init__(self, session_id: _Optional[str] = ..., sandbox_name: _Optional[str] = ..., task_id: _Optional[str] = ...) -> None: ...

class ExecRequest(_message.Message):
    __slots__ = ("session_id", "shell", "argv", "timeout_seconds", "workdir", "env", "stdin")
    class EnvEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SHELL_FIELD_NUMBER: _ClassVar[int]
    ARGV_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WORKDIR_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    STDIN_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    shell: str
    argv: ArgvCommand
    timeout_seconds: float
    workdir: str
    env: _containers.ScalarMap[str, str]
    stdin: bytes
    def __init__(self, session_id: _Optional[str] = ..., shell: _Optional[str] = ..., argv: _Optional[_Union[ArgvCommand, _Mapping]] = ..., timeout_seconds: _Optional[float] = ..., workdir: _Optional[str] = ..., env: _Optional[_Mapping[str, str]] = ..., stdin: _Optional[bytes] = ...) -> None: ...

class ArgvCommand(_message.Message):
    __slots__ = ("args",)
    ARGS_FIELD_NUMBER: _ClassVar[int]
    args: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, args: _Optional[_Iterable[str]] = ...) -> None: ...

class ExecResponse(_message.Message):
    __slots__ = ("exit_code", "stdout", "stderr", "timed_out", "oom_killed", "truncated", "duration_seconds")
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    STDOUT_FIELD_NUMBER: _ClassVar[int]
    STDERR_FIELD_NUMBER: _ClassVar[int]
    TIMED_OUT_FIELD_NUMBER: _ClassVar[int]
    OOM_KILLED_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    DURATION_SECONDS_FIELD_NUMBER: _ClassVar[int]
    exit_code: int
    stdout: str
    stderr: str
    timed_out: bool
    oom_killed: bool
    truncated: bool
    duration_seconds: float
    def __init__(self, exit_code: _Optional[int] = ..., stdout: _Optional[str] = ..., stderr: _Optional[str] = ..., timed_out: _Optional[bool] = ..., oom_killed: _Optional[bool] = ..., truncated: _Optional[bool] = ..., duration_seconds: _Optional[float] = ...) -> None: ...

class ReadFileRequest(_message.Message):
    __slots__ = ("session_id", "path", "max_bytes")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    path: str
    max_bytes: int
    def __init__(self, session_id: _Optional[str] = ..., path: _Optional[str] = ..., max_bytes: _Optional[int] = ...) -> None: ...

class ReadFileResponse(_message.Message):
    __slots__ = ("data",)
    DATA_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    def __init__(self, data: _Optional[bytes] = ...) -> None: ...

class WriteFileRequest(_message.Message):
    __slots__ = ("session_id", "path", "data", "mode")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    path: str
    data: bytes
    mode: int
    def __init__(self, session_id: _Optional[str] = ..., path: _Optional[str] = ..., data: _Optional[bytes] = ..., mode: _Optional[int] = ...) -> None: ...

class WriteFileResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class VerifyRequest(_message.Message):
    __slots__ = ("session_id", "task_json", "answer", "has_answer")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_JSON_FIELD_NUMBER: _ClassVar[int]
    ANSWER_FIELD_NUMBER: _ClassVar[int]
    HAS_ANSWER_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    task_json: str
    answer: str
    has_answer: bool
    def __init__(self, session_id: _Optional[str] = ..., task_json: _Optional[str] = ..., answer: _Optional[str] = ..., has_answer: _Optional[bool] = ...) -> None: ...

class VerifyResponse(_message.Message):
    __slots__ = ("reward", "parts", "output", "flags")
    class PartsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    REWARD_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    FLAGS_FIELD_NUMBER: _ClassVar[int]
    reward: float
    parts: _containers.ScalarMap[str, float]
    output: str
    flags: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, reward: _Optional[float] = ..., parts: _Optional[_Mapping[str, float]] = ..., output: _Optional[str] = ..., flags: _Optional[_Iterable[str]] = ...) -> None: ...

class DestroySessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class DestroySessionResponse(_message.Message):
    __slots__ = ("destroyed",)
    DESTROYED_FIELD_NUMBER: _ClassVar[int]
    destroyed: bool
    def __init__(self, destroyed: _Optional[bool] = ...) -> None: ...
