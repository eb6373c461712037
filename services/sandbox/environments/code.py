"""Code tasks (tool-integrated reasoning): the agent runs Python snippets, then answers.

TaskSet record:

    {"id": "sum-squares", "type": "code",
     "question": "What is the sum of the squares of 1..100?",
     "answer": "338350"}                  # one string or a list of accepted aliases

Tool: `python(code)` runs the snippet with the sandbox's python3 in the workspace (files
persist between calls; variables do not) and returns stdout, stderr and the exit code, capped
like any exec. The reward is 1 when the normalised final answer matches an alias (numbers
compare by value: `338350.0` == `338350`). Reference solution: `{id}.py`; the last line it
prints is its answer.

Not covered: a persistent interpreter (REPL state between calls).
"""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from ..interface import ExecResult, Sandbox
from .base import Environment, TaskBase, VerifyResult, normalize_answer


class CodeTask(TaskBase):
    type: Literal["code"] = "code"
    question: str = Field(min_length=1)
    answer: str | list[str]

    def aliases(self) -> list[str]:
        return [self.answer] if isinstance(self.answer, str) else list(self.answer)


class CodeEnvironment(Environment):
    type = "code"
    task_model = CodeTask
    solution_name = "{id}.py"

    async def run_python(self, sandbox: Sandbox, code: str, timeout: float = 30.0) -> ExecResult:
        return await sandbox.exec(["python3", "-I", "-"], stdin=code.encode(), timeout=timeout)

    async def setup(self, sandbox: Sandbox, task: CodeTask) -> None:
        return None

    async def verify(self, sandbox: Sandbox, task: CodeTask, answer: str | None = None
                     ) -> VerifyResult:
        if answer is None:
            return VerifyResult(0.0, parts={"exact": 0.0}, output="no answer given",
                                flags=["no_answer"])
        got = normalize_answer(answer)
        accepted = [normalize_answer(a) for a in task.aliases()]
        ok = got in accepted
        return VerifyResult(float(ok), parts={"exact": float(ok)},
                            output=f"answer {got!r}; accepted {accepted}")

    async def apply_solution(self, sandbox: Sandbox, task: CodeTask, solution: bytes
                             ) -> str | None:
        res = await self.run_python(sandbox, solution.decode("utf-8"), task.timeout_seconds)
        if not res.ok:
            raise RuntimeError(f"task {task.id}: reference solution failed: {res.stderr[-2000:]}")
        lines = [l for l in res.stdout.splitlines() if l.strip()]
        return lines[-1] if lines else ""
