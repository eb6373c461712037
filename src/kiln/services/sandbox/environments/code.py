"""Code tasks (tool-integrated reasoning and programming): the agent runs Python, then answers
or submits a solution that hidden tests grade.

Task records, either kind:

    {"id": "sum-squares", "type": "code",
     "question": "What is the sum of the squares of the integers 1 to 100?",
     "answer": "338350"}                  # one string or a list of accepted aliases

    {"id": "fizz", "type": "code",
     "question": "Write solution.py defining fizz(n): 'Fizz' for multiples of 3, else str(n).",
     "tests": "from solution import fizz\\nassert fizz(3) == 'Fizz'\\nassert fizz(4) == '4'\\n"}

Tools: `python` (runs a snippet with the sandbox's python3 in the workspace: files persist
between calls, variables do not; stdout, stderr and the exit code come back, cut), `write_file`
and, for solution tasks, `submit`. An answer task ends with the reply that calls no tool (its
text is the answer; numbers compare by value: `338350.0` == `338350`). A solution task is graded
by its `tests`, written into the sandbox only after the episode and run with `python3 -I`
(`verifier.py`); reward 1 when the verifier's report says they ran to their end (an exit of any
code, or an exception, before the end fails; the exit code is not read). Reference solution:
`{id}.py`; for an answer task the last line it prints is its answer, for a solution task it
is written to solution.py.

Not covered: a persistent interpreter (REPL state between calls).
"""
from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from kiln.env import Grade, SandboxHandle, ToolCall, ToolResult, ToolSpec, string_tool
from .base import (SUBMIT, WRITE_FILE, Environment, Task, format_exec, kill_leftovers,
                   normalize_answer, unknown_tool)
from .verifier import run_tests

PYTHON = string_tool("python", "Run a Python snippet in the workspace; returns its exit code, "
                     "stdout and stderr.", code="the Python source to run")
#: In the workspace root, so that the tests import the solution from there; written only at
#: grading (the agent never sees it) and removed after.
TESTS_PATH = ".kiln-test-solution.py"


class CodeTask(Task):
    type: Literal["code"] = "code"
    question: str = Field(min_length=1)
    answer: str | list[str] | None = None
    tests: str | None = None
    """Hidden tests (Python, run from the workspace) that grade a solution task."""
    run_timeout_seconds: float = Field(30.0, gt=0)
    """Wall-clock limit of one `python` call of the agent."""

    @model_validator(mode="after")
    def _kind(self) -> "CodeTask":
        if (self.answer is None) == (self.tests is None):
            raise ValueError("exactly one of answer (an answer task) or tests (a solution task) "
                             "must be set")
        return self

    def aliases(self) -> list[str]:
        return [self.answer] if isinstance(self.answer, str) else list(self.answer or [])


class CodeEnvironment(Environment):
    type = "code"
    task_model = CodeTask
    solution_name = "{id}.py"

    async def run_python(self, sandbox: SandboxHandle, code: str, timeout: float = 30.0):
        return await sandbox.exec(["python3", "-I", "-"], stdin=code.encode(), timeout=timeout)

    def system_prompt(self, task: CodeTask) -> str:
        if task.tests is not None:
            return "Write the solution with the tools, check it with python, then call submit."
        return "Use the python tool to compute the answer, then reply with the answer alone."

    def user_prompt(self, task: CodeTask) -> str:
        return task.question

    def tools(self, task: CodeTask) -> list[ToolSpec]:
        return [PYTHON, WRITE_FILE, SUBMIT] if task.tests is not None else [PYTHON]

    async def call_tool(self, sandbox: SandboxHandle, task: CodeTask, call: ToolCall) -> ToolResult:
        if call.name == "python":
            code = call.arguments.get("code")
            if not isinstance(code, str):
                return ToolResult("error: python needs a string argument `code`")
            return ToolResult(format_exec(await self.run_python(sandbox, code, task.run_timeout_seconds)))
        if task.tests is not None and call.name == "write_file":
            return await self.write_text(sandbox, call)
        if task.tests is not None and call.name == "submit":
            return ToolResult("submitted", done=True)
        return unknown_tool(call, self.tools(task))

    async def grade(self, sandbox: SandboxHandle, task: CodeTask, answer: str | None = None) -> Grade:
        if task.tests is not None:
            await kill_leftovers(sandbox)
            await sandbox.write_file(TESTS_PATH, task.tests.encode())
            # `python3 -I`: the workspace goes on the import path after the standard library
            # (a `json.py` beside the solution shadows nothing); the verdict is the verifier's
            # report that the tests ran to their end (an `os._exit(0)` at import writes none).
            run = await run_tests(sandbox, "script", [TESTS_PATH], timeout=task.timeout_seconds)
            await sandbox.exec(["rm", "-f", TESTS_PATH], timeout=10)
            ok = float(run.passed(TESTS_PATH))
            return Grade(ok, parts={"tests_passed": ok}, output=run.log[-8000:],
                         flags=["verifier_timeout"] if run.timed_out else [])
        if answer is None or not answer.strip():
            return Grade(0.0, parts={"exact": 0.0}, output="no answer given", flags=["no_answer"])
        got = normalize_answer(answer)
        accepted = [normalize_answer(a) for a in task.aliases()]
        ok = got in accepted
        return Grade(float(ok), parts={"exact": float(ok)}, output=f"answer {got!r}; accepted {accepted}")

    async def apply_solution(self, sandbox: SandboxHandle, task: CodeTask, solution: bytes
                             ) -> str | None:
        if task.tests is not None:
            await sandbox.write_file("solution.py", solution)
            return None
        res = await self.run_python(sandbox, solution.decode("utf-8"), task.timeout_seconds)
        if not res.ok:
            raise RuntimeError(f"task {task.id}: reference solution failed: {res.stderr[-2000:]}")
        lines = [line for line in res.stdout.splitlines() if line.strip()]
        return lines[-1] if lines else ""
