"""Terminal tasks: a description, an environment set-up, a test script; reward 1 if it passes.

TaskSet record (one JSON object per line):

    {"id": "make-hello", "type": "terminal",
     "description": "Create hello.txt containing the word hello.",
     "setup": "mkdir -p data",                     # shell, run in /workspace before the agent
     "files": {"data/input.txt": "1 2 3\n"},       # optional initial files
     "test_script": "test \"$(cat hello.txt)\" = hello",
     "timeout_seconds": 60}

The test script is written into the sandbox only at verification time, outside the agent's
reach during its turn, and runs with the workspace as its folder. Reference solution:
`{id}.sh`, a shell script run in the workspace.

Not covered: multi-container tasks (services beside the sandbox).
"""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from ..interface import Sandbox
from .base import Environment, TaskBase, VerifyResult, kill_leftovers

TEST_PATH = ".kiln-verifier/test.sh"


class TerminalTask(TaskBase):
    type: Literal["terminal"] = "terminal"
    description: str = Field(min_length=1)
    setup: str = ""
    files: dict[str, str] = Field(default_factory=dict)
    test_script: str = Field(min_length=1)


class TerminalEnvironment(Environment):
    type = "terminal"
    task_model = TerminalTask
    solution_name = "{id}.sh"

    async def setup(self, sandbox: Sandbox, task: TerminalTask) -> None:
        for path, text in task.files.items():
            await sandbox.write_file(path, text.encode())
        if task.setup:
            res = await sandbox.exec(task.setup, timeout=task.timeout_seconds)
            if not res.ok:
                raise RuntimeError(f"task {task.id}: setup failed with exit {res.exit_code}: "
                                   f"{res.stderr[-2000:]}")

    async def verify(self, sandbox: Sandbox, task: TerminalTask, answer: str | None = None
                     ) -> VerifyResult:
        await kill_leftovers(sandbox)
        await sandbox.exec("rm -rf .kiln-verifier", timeout=10)
        await sandbox.write_file(TEST_PATH, task.test_script.encode(), mode=0o755)
        res = await sandbox.exec(["/bin/sh", TEST_PATH], timeout=task.timeout_seconds)
        await sandbox.exec("rm -rf .kiln-verifier", timeout=10)
        passed = res.ok
        flags = ["verifier_timeout"] if res.timed_out else []
        return VerifyResult(reward=1.0 if passed else 0.0, parts={"tests_passed": float(passed)},
                            output=(res.stdout + res.stderr)[-8000:], flags=flags)

    async def apply_solution(self, sandbox: Sandbox, task: TerminalTask, solution: bytes
                             ) -> str | None:
        await sandbox.write_file(".kiln-solution.sh", solution, mode=0o755)
        await sandbox.exec(["/bin/sh", ".kiln-solution.sh"], timeout=task.timeout_seconds)
        await sandbox.exec("rm -f .kiln-solution.sh", timeout=10)
        return None
