"""Terminal tasks: a description, an environment set-up, a test script; reward 1 if it passes.

Task record (one JSON object per line):

    {"id": "make-hello", "type": "terminal",
     "description": "Create hello.txt containing the word hello.",
     "setup": "mkdir -p data",                     # shell, run in /workspace before the agent
     "files": {"data/input.txt": "1 2 3\\n"},       # optional initial files
     "test_script": "test \\"$(cat hello.txt)\\" = hello",
     "solution_commands": ["echo hello > hello.txt"],   # optional: the SFT demonstration
     "timeout_seconds": 60}

Tools: `bash` (exit code, stdout and stderr, each cut with a marker), `read_file`, `write_file`,
`submit`. The test script is written into the sandbox only at grading, after every process the
agent left is killed, so the agent can neither read nor edit it; it runs with the workspace as
its folder. Reference solution for `kiln sandbox verify`: `{id}.sh`, a shell script run in the
workspace; `solution_commands`, when given, are the demonstration SFT imitates (each a `bash`
call, then `submit`).

Not covered: multi-container tasks (services beside the sandbox).
"""
from __future__ import annotations

import random
from typing import Literal

from pydantic import Field

from kiln.env import AssistantTurn, Grade, SandboxHandle, ToolCall, ToolResult, ToolSpec
from .base import (BASH, READ_FILE, SUBMIT, WRITE_FILE, Environment, Task, kill_leftovers,
                   unknown_tool)

TEST_PATH = ".kiln-verifier/test.sh"
TOOLS = [BASH, READ_FILE, WRITE_FILE, SUBMIT]


class TerminalTask(Task):
    type: Literal["terminal"] = "terminal"
    description: str = Field(min_length=1)
    setup: str = ""
    files: dict[str, str] = Field(default_factory=dict)
    test_script: str = Field(min_length=1)
    solution_commands: list[str] = Field(default_factory=list)
    command_timeout_seconds: float = Field(30.0, gt=0)
    """Wall-clock limit of one `bash` call of the agent."""


class TerminalEnvironment(Environment):
    type = "terminal"
    task_model = TerminalTask
    solution_name = "{id}.sh"

    def system_prompt(self, task: TerminalTask) -> str:
        return ("You work in a Linux shell, in /workspace. Use the tools to complete the task, "
                "then call submit.")

    def user_prompt(self, task: TerminalTask) -> str:
        return task.description

    def tools(self, task: TerminalTask) -> list[ToolSpec]:
        return TOOLS

    async def setup(self, sandbox: SandboxHandle, task: TerminalTask) -> None:
        for path, text in task.files.items():
            await sandbox.write_file(path, text.encode())
        if task.setup:
            res = await sandbox.exec(task.setup, timeout=task.timeout_seconds)
            if not res.ok:
                raise RuntimeError(f"task {task.id}: setup failed with exit {res.exit_code}: "
                                   f"{res.stderr[-2000:]}")

    async def call_tool(self, sandbox: SandboxHandle, task: TerminalTask,
                        call: ToolCall) -> ToolResult:
        if call.name == "bash":
            return await self.run_bash(sandbox, call, task.command_timeout_seconds)
        if call.name == "read_file":
            return await self.read_text(sandbox, call)
        if call.name == "write_file":
            return await self.write_text(sandbox, call)
        if call.name == "submit":
            return ToolResult("submitted", done=True)
        return unknown_tool(call, TOOLS)

    async def grade(self, sandbox: SandboxHandle, task: TerminalTask,
                    answer: str | None = None) -> Grade:
        await kill_leftovers(sandbox)
        await sandbox.exec("rm -rf .kiln-verifier", timeout=10)
        await sandbox.write_file(TEST_PATH, task.test_script.encode(), mode=0o755)
        res = await sandbox.exec(["/bin/sh", TEST_PATH], timeout=task.timeout_seconds)
        await sandbox.exec("rm -rf .kiln-verifier", timeout=10)
        passed = res.ok
        flags = ["verifier_timeout"] if res.timed_out else []
        return Grade(reward=1.0 if passed else 0.0, parts={"tests_passed": float(passed)},
                     output=(res.stdout + res.stderr)[-8000:], flags=flags)

    def demonstrate(self, task: TerminalTask, rng: random.Random) -> list[AssistantTurn] | None:
        if not task.solution_commands:
            return None
        turns = [AssistantTurn(tool_calls=[ToolCall("bash", {"command": c})])
                 for c in task.solution_commands]
        return turns + [AssistantTurn(tool_calls=[ToolCall("submit", {})])]

    async def apply_solution(self, sandbox: SandboxHandle, task: TerminalTask, solution: bytes
                             ) -> str | None:
        await sandbox.write_file(".kiln-solution.sh", solution, mode=0o755)
        await sandbox.exec(["/bin/sh", ".kiln-solution.sh"], timeout=task.timeout_seconds)
        await sandbox.exec("rm -f .kiln-solution.sh", timeout=10)
        return None
