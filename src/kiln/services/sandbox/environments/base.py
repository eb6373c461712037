"""What the built-in environments share: the environment interface (`kiln.env.Environment`)
plus reference solutions, the tools most of them offer, and answer normalisation.

Every built-in environment (chain, terminal, swe, search, code) is a `kiln.env.Environment`:
a pydantic task record (one JSONL line of a task set), the prompt and tools of its episodes,
what each tool does in the episode's sandbox, and `grade`. On top of that interface, built-in
ones can play a reference solution (`apply_solution`, used by `kiln sandbox verify` to check a
task set) read from a solutions folder (`solution_name`).

Not covered: the episode loop (`episodes.py`) and the tools' wire format (rollout's formats).
"""
from __future__ import annotations

import string
from typing import ClassVar

from kiln.env import Environment as EnvironmentInterface
from kiln.env import SandboxHandle, Task, ToolCall, ToolResult, ToolSpec, string_tool

#: Output of one tool call shown to the model, per stream; more is cut behind a marker.
TOOL_OUTPUT_CHARS = 4000

BASH = string_tool("bash", "Run a shell command in the workspace; returns its exit code, stdout "
                   "and stderr.", command="the command, run with /bin/sh -c")
READ_FILE = string_tool("read_file", "Read a text file of the workspace.",
                        path="path relative to the workspace")
WRITE_FILE = string_tool("write_file", "Create or overwrite a text file of the workspace.",
                         path="path relative to the workspace", content="the file's new content")
SUBMIT = ToolSpec("submit", "Say that the task is done; the episode ends and is graded.")


class Environment(EnvironmentInterface):
    """A built-in environment."""

    #: File name of a task's reference solution in a solutions folder, `{id}` substituted.
    solution_name: ClassVar[str]
    #: End the episode (graded as it stands, flagged `invalid_action`) when a reply cannot be
    #: read as tool calls or an answer, instead of telling the model and going on.
    end_on_invalid_action: ClassVar[bool] = False

    async def apply_solution(self, sandbox: SandboxHandle, task: Task, solution: bytes
                             ) -> str | None:
        """Play a reference solution; return the final answer where the task has one."""
        raise NotImplementedError(f"{type(self).__name__} has no reference solutions")

    # Shared tool implementations ---------------------------------------------------------

    async def run_bash(self, sandbox: SandboxHandle, call: ToolCall, timeout: float) -> ToolResult:
        command = call.arguments.get("command")
        if not isinstance(command, str) or not command.strip():
            return ToolResult("error: bash needs a non-empty string argument `command`")
        res = await sandbox.exec(command, timeout=timeout)
        return ToolResult(format_exec(res))

    async def read_text(self, sandbox: SandboxHandle, call: ToolCall) -> ToolResult:
        path = call.arguments.get("path")
        if not isinstance(path, str):
            return ToolResult("error: read_file needs a string argument `path`")
        try:
            data = await sandbox.read_file(path, TOOL_OUTPUT_CHARS + 1)
        except (FileNotFoundError, ValueError, OSError) as exc:
            return ToolResult(f"error: {exc}")
        text = data.decode("utf-8", "replace")
        return ToolResult(truncate(text, TOOL_OUTPUT_CHARS))

    async def write_text(self, sandbox: SandboxHandle, call: ToolCall) -> ToolResult:
        path, content = call.arguments.get("path"), call.arguments.get("content")
        if not isinstance(path, str) or not isinstance(content, str):
            return ToolResult("error: write_file needs string arguments `path` and `content`")
        try:
            await sandbox.write_file(path, content.encode())
        except (ValueError, OSError) as exc:
            return ToolResult(f"error: {exc}")
        return ToolResult(f"wrote {len(content.encode())} bytes to {path}")


def unknown_tool(call: ToolCall, tools: list[ToolSpec]) -> ToolResult:
    return ToolResult(f"error: unknown tool {call.name!r} (tools: "
                      f"{', '.join(t.name for t in tools)})")


def truncate(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    return text[:limit] + f"\n[output truncated: {len(text) - limit} more characters]"


def format_exec(res) -> str:
    """An exec's result as the model sees it: exit code, then stdout and stderr, each cut."""
    out = f"exit code {res.exit_code}"
    if res.timed_out:
        out += " (timed out)"
    if res.stdout:
        out += "\nstdout:\n" + truncate(res.stdout, TOOL_OUTPUT_CHARS)
    if res.stderr:
        out += "\nstderr:\n" + truncate(res.stderr, TOOL_OUTPUT_CHARS)
    return out


def normalize_answer(text: str) -> str:
    """Lowercase, drop punctuation, articles and extra spaces: `The  Eiffel-Tower.` ->
    `eiffel tower`. Numbers keep their decimal point (`3.50` -> `3.5`)."""
    text = text.strip().lower()
    try:
        number = float(text.replace(",", ""))
        return repr(int(number)) if number == int(number) else repr(number)
    except (ValueError, OverflowError):
        pass
    text = "".join(" " if ch in string.punctuation else ch for ch in text)
    words = [w for w in text.split() if w not in ("a", "an", "the")]
    return " ".join(words)


def token_f1(answer: str, reference: str) -> float:
    """F1 of the normalised answer's words against the reference's (SQuAD-style)."""
    got, want = normalize_answer(answer).split(), normalize_answer(reference).split()
    if not got or not want:
        return float(got == want)
    common = sum(min(got.count(w), want.count(w)) for w in set(got))
    if common == 0:
        return 0.0
    precision, recall = common / len(got), common / len(want)
    return 2 * precision * recall / (precision + recall)


async def kill_leftovers(sandbox: SandboxHandle) -> None:
    """Stop any process the agent left running before the verifier looks at the state (it
    could otherwise rewrite files while they are checked)."""
    await sandbox.exec("kill -9 -1 2>/dev/null; true", timeout=10)
