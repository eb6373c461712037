"""The chain task's reward, and the task in the sandbox service's `Environment` interface."""
from __future__ import annotations

import re
from typing import ClassVar

from ...interface import Sandbox
from ..base import Environment, TaskBase, VerifyResult
from .tasks import ChainTask


def verify(task: ChainTask, final_answer: str | None) -> tuple[float, dict[str, float], str]:
    """(reward 0/1, parts, verifier output) for the text inside `<answer>` (None: the episode
    ended without an answer). The answer must be a decimal integer equal to `task.answer`."""
    if final_answer is None:
        return 0.0, {"answered": 0.0, "correct": 0.0}, "no answer"
    text = final_answer.strip()
    if not re.fullmatch(r"-?[0-9]{1,32}", text):
        return 0.0, {"answered": 1.0, "correct": 0.0}, f"not an integer: {text[:40]!r}"
    if int(text) != task.answer:
        return 0.0, {"answered": 1.0, "correct": 0.0}, f"answered {int(text)}, expected {task.answer}"
    return 1.0, {"answered": 1.0, "correct": 1.0}, "correct"


class ChainEnvironment(Environment):
    """`chain` in the sandbox service's environment interface. The task needs no state in the
    sandbox (the calculator is stateless), so setup does nothing and the reward depends on the
    final answer alone. A reference solution is a file holding the answer."""

    type: ClassVar[str] = "chain"
    task_model: ClassVar[type[TaskBase]] = ChainTask
    solution_name: ClassVar[str] = "{id}.txt"

    async def setup(self, sandbox: Sandbox, task: TaskBase) -> None:
        return None

    async def verify(self, sandbox: Sandbox, task: TaskBase, answer: str | None = None
                     ) -> VerifyResult:
        if not isinstance(task, ChainTask):
            raise TypeError(f"chain environment got a {type(task).__name__} task")
        reward, parts, output = verify(task, answer)
        return VerifyResult(reward=reward, parts=parts, output=output)

    async def apply_solution(self, sandbox: Sandbox, task: TaskBase, solution: bytes
                             ) -> str | None:
        return solution.decode("ascii").strip()
