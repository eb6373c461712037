"""The one interface every sandbox backend implements, and what an exec returns.

A `Sandbox` is a live isolated environment with a writable workspace: create it, run commands
in it (`exec`), move files in and out, destroy it. Backends differ in how they isolate (see
`bubblewrap.py`, `docker_backend.py`); callers never look past this interface.

Not covered: sessions, pools and TTLs (`sessions.py`), verification (`environments/`).
"""
from __future__ import annotations

import abc
import posixpath
from dataclasses import dataclass, field

#: Exit code reported for a command killed because its timeout passed (as coreutils' timeout).
EXIT_TIMEOUT = 124
#: Exit code reported for a command killed by the OOM killer (128 + SIGKILL).
EXIT_OOM = 137

#: Where the workspace appears inside every sandbox.
WORKSPACE = "/workspace"


class SandboxError(RuntimeError):
    """A sandbox operation failed. `retryable` says whether trying again may help."""

    def __init__(self, message: str, *, retryable: bool = False) -> None:
        super().__init__(message)
        self.retryable = retryable


class WorkspaceFull(SandboxError):
    """A file could not be written: the workspace reached its disk quota. Not retryable as is
    (the sandbox's commands must free space first)."""


class PathEscapeError(ValueError):
    """A file path leaves the workspace (`..`, an absolute path elsewhere, a symlink).
    Retrying never helps."""


@dataclass
class ExecResult:
    """Outcome of one command. `exit_code` is the command's own unless it was killed:
    124 after a timeout, 137 after an OOM kill."""

    exit_code: int
    stdout: str
    stderr: str
    timed_out: bool = False
    oom_killed: bool = False
    truncated: bool = False
    """True when stdout or stderr passed the output limit and was cut (marker appended)."""
    duration_s: float = 0.0
    extra: dict[str, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out and not self.oom_killed


class Sandbox(abc.ABC):
    """A live sandbox. All methods are coroutines so thousands can be driven from one loop."""

    #: Unique name: `<prefix>-<owner>-<id>`; cgroups, containers and folders carry it.
    name: str

    @abc.abstractmethod
    async def start(self) -> None:
        """Create the sandbox's resources (workspace, cgroups, container)."""

    @abc.abstractmethod
    async def exec(
        self,
        cmd: str | list[str],
        *,
        timeout: float | None = None,
        workdir: str | None = None,
        env: dict[str, str] | None = None,
        stdin: bytes | None = None,
    ) -> ExecResult:
        """Run `cmd` (a shell string, or an argv list) in the sandbox; never raises for the
        command's own failure, only for a broken sandbox (SandboxError)."""

    @abc.abstractmethod
    async def read_file(self, path: str, max_bytes: int | None = None) -> bytes:
        """Bytes of a regular file inside the workspace. PathEscapeError for paths that leave
        it; FileNotFoundError when it does not exist."""

    @abc.abstractmethod
    async def write_file(self, path: str, data: bytes, mode: int = 0o644) -> None:
        """Create or replace a regular file inside the workspace (parents are created)."""

    @abc.abstractmethod
    async def destroy(self) -> None:
        """Kill everything and remove every resource; safe to call twice."""

    async def __aenter__(self) -> "Sandbox":
        try:
            await self.start()
        except BaseException:
            # A half-made sandbox (cgroup made, container created, then cancelled) is still
            # ours to remove.
            await self.destroy()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.destroy()


def workspace_relpath(path: str) -> str:
    """Normalise a user path to a relative path inside the workspace, or raise.

    Accepts `a/b`, `./a/b` and `/workspace/a/b`; rejects `..` that climbs out, other absolute
    paths and empty names. Symlinks are each backend's job (they need the file system)."""
    if not path or "\x00" in path:
        raise PathEscapeError(f"path: empty or NUL-containing path {path!r}")
    if path.startswith("/"):
        norm = posixpath.normpath(path)
        if norm == WORKSPACE:
            raise PathEscapeError(f"path: {path!r} is the workspace itself, not a file")
        if not norm.startswith(WORKSPACE + "/"):
            raise PathEscapeError(f"path: {path!r} is outside {WORKSPACE}")
        path = norm[len(WORKSPACE) + 1:]
    norm = posixpath.normpath(path)
    if norm in (".", "") or norm == ".." or norm.startswith("../"):
        raise PathEscapeError(f"path: {path!r} leaves the workspace")
    return norm
