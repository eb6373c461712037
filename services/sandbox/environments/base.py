"""What an environment is: a task record type, how to prepare a sandbox, how to score it.

Every environment (terminal, swe, search, code) defines a pydantic task record (one JSONL line
of a TaskSet), `setup` (put the task's initial state into a fresh sandbox), `verify` (turn the
sandbox's final state, and the agent's final answer where there is one, into a reward) and
`apply_solution` (play a reference solution, used by `kiln sandbox verify` to check a TaskSet).

Not covered: the agent loop itself (the rollout service) and the tools' wire format.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from pydantic import BaseModel, ConfigDict, Field

from ..interface import Sandbox


class TaskBase(BaseModel):
    """Fields every task record has."""

    model_config = ConfigDict(extra="forbid")

    id: str = Field(min_length=1)
    """Unique within its TaskSet; names the task in errors and in the reference solutions."""
    image: str | None = None
    """Container image for the docker backend; None means the service's default image."""
    timeout_seconds: float = Field(default=60.0, gt=0)
    """Limit for each verifier command."""


@dataclass
class VerifyResult:
    reward: float
    parts: dict[str, float] = field(default_factory=dict)
    output: str = ""
    flags: list[str] = field(default_factory=list)
    """Things a trajectory filter must know, e.g. `tests_modified` (an exploit attempt)."""


class Environment(abc.ABC):
    """One task type. Stateless: all state is in the task record and the sandbox."""

    type: ClassVar[str]
    task_model: ClassVar[type[TaskBase]]
    #: File name of a task's reference solution in a solutions folder, `{id}` substituted.
    solution_name: ClassVar[str]

    def __init__(self, base_dir: Path | None = None) -> None:
        #: Folder that relative paths in task records (repos, corpora) are resolved against:
        #: the TaskSet file's folder.
        self.base_dir = base_dir or Path.cwd()

    def resolve(self, path: str) -> Path:
        p = Path(path)
        return p if p.is_absolute() else (self.base_dir / p).resolve()

    @abc.abstractmethod
    async def setup(self, sandbox: Sandbox, task: TaskBase) -> None:
        """Bring a fresh sandbox to the task's initial state."""

    @abc.abstractmethod
    async def verify(self, sandbox: Sandbox, task: TaskBase, answer: str | None = None
                     ) -> VerifyResult:
        """Score the sandbox's state (and `answer`, for answer-type tasks)."""

    @abc.abstractmethod
    async def apply_solution(self, sandbox: Sandbox, task: TaskBase, solution: bytes
                             ) -> str | None:
        """Play a reference solution; return the final answer where the task has one."""


def normalize_answer(text: str) -> str:
    """Lowercase, drop punctuation, articles and extra spaces: `The  Eiffel-Tower.` ->
    `eiffel tower`. Numbers keep their decimal point (`3.50` -> `3.5`)."""
    import string
    text = text.strip().lower()
    try:
        number = float(text.replace(",", ""))
        return repr(int(number)) if number == int(number) else repr(number)
    except (ValueError, OverflowError):
        pass
    text = "".join(" " if ch in string.punctuation else ch for ch in text)
    words = [w for w in text.split() if w not in ("a", "an", "the")]
    return " ".join(words)


async def kill_leftovers(sandbox: Sandbox) -> None:
    """Stop any process the agent left running before the verifier looks at the state (it
    could otherwise rewrite files while they are checked)."""
    await sandbox.exec("kill -9 -1 2>/dev/null; true", timeout=10)
