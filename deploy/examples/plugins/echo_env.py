"""An example environment plugin and reward plugin for Kiln.

Put this folder on PYTHONPATH and name them in a job's task set:

    tasks:
      - name: echo
        env: {plugin: "echo_env:EchoFileEnv"}
        reward: {plugin: "echo_env:shorter_is_better"}
        path: tasks/echo.jsonl

`EchoFileEnv`: write a given word into a given file with the `bash` tool, then `submit`; the
grade reads the file from the episode's sandbox. `shorter_is_better` keeps that grade and takes
a tenth off for every tool call beyond the two a solution needs.
"""
from __future__ import annotations

import random

from pydantic import Field

from kiln.env import (AssistantTurn, Environment, Grade, Task, ToolCall, ToolResult, ToolSpec,
                      string_tool)

BASH = string_tool("bash", "Run a shell command in the workspace.", command="the command")
SUBMIT = ToolSpec("submit", "Say the task is done.")


class EchoTask(Task):
    word: str = Field(pattern=r"^[a-z]+$")
    file: str = Field(pattern=r"^[a-z]+\.txt$")


class EchoFileEnv(Environment):
    task_model = EchoTask

    def user_prompt(self, task: EchoTask) -> str:
        return f"Write the word {task.word} into {task.file}, then submit."

    def tools(self, task: EchoTask) -> list[ToolSpec]:
        return [BASH, SUBMIT]

    async def call_tool(self, sandbox, task: EchoTask, call: ToolCall) -> ToolResult:
        if call.name == "submit":
            return ToolResult("submitted", done=True)
        if call.name != "bash" or not isinstance(call.arguments.get("command"), str):
            return ToolResult("error: call bash with a `command`, or submit")
        res = await sandbox.exec(call.arguments["command"], timeout=10)
        return ToolResult(f"exit code {res.exit_code}\n{res.stdout}{res.stderr}")

    async def grade(self, sandbox, task: EchoTask, answer: str | None) -> Grade:
        try:
            data = (await sandbox.read_file(task.file, 1024)).decode().strip()
        except FileNotFoundError:
            return Grade(0.0, {"written": 0.0}, f"{task.file} does not exist")
        ok = data == task.word
        return Grade(float(ok), {"written": float(ok)}, f"{task.file} holds {data[:40]!r}")

    def demonstrate(self, task: EchoTask, rng: random.Random) -> list[AssistantTurn]:
        return [AssistantTurn(tool_calls=[ToolCall("bash", {"command": f"echo {task.word} > {task.file}"})]),
                AssistantTurn(tool_calls=[ToolCall("submit", {})])]


def shorter_is_better(task: EchoTask, grade: Grade, transcript) -> Grade:
    calls = sum(len(turn.tool_calls) for turn in transcript)
    penalty = 0.1 * max(0, calls - 2)
    return Grade(max(0.0, grade.reward - penalty), {"length_penalty": penalty})
