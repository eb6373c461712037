"""`lookup`, the terminal quickstart's task family: follow a chain of lookups through files with
the shell, then write the result and finish.

A task: the folder `notes/` holds a file for every number 10..99, and each file names another
(`notes/37` holds `82`; a random permutation per task); starting at K, read notes/K, then
the file it names, `hops` times, write the last number into answer.txt and finish. Each read's
result must be copied into the next command, as an agent copies what it observed:

    user       Start at 37: cat notes/37, then the file it names, 3 times; write the last
               number to answer.txt.
    assistant  <tool_call>{"name": "bash", "arguments": {"command": "cat notes/37"}}</tool_call>
    tool       82                           (a command's output; exit code and stderr on failure)
    assistant  ... "cat notes/82" ... "cat notes/10" ...
    assistant  ... "echo 64 > answer.txt" ...    then   Done.   (a reply without a call ends it)

Shaped for a 0.4 M-parameter model (see docs/quickstart-notes.md): one value per file, so an
output is the value alone (a `grep ^K: notes.txt` line repeats the key before it, and the tiny
model never learned which of the two to copy), and two-digit numbers only, each one token of
the job's tokenizer (`tokenizer_words`), so every copy is one token the same distance back.

The reward is the task's test script (`test "$(cat answer.txt)" = 64`), run after the episode.

`demonstrate` is a scripted solver with one systematic blind spot, as the quickstart's: when it
copies a number that ends in 0 it drops the 0 (`30` becomes `3`) three times in four, and goes
on from a file that does not exist. Imitation learns the blind spot; the 0/1 reward lets RL unlearn it. The
solver knows the file, so its demonstrations carry the tool's output without a sandbox.

Train and held-out tasks are told apart by a hash of their start and map, so no seed gives a
training task that is also held out.
"""
from __future__ import annotations

import hashlib
import random
from typing import Literal

from pydantic import Field

from kiln.env import AssistantTurn, Grade, SandboxHandle, ToolCall, ToolResult, ToolSpec, string_tool
from .base import format_exec
from .terminal import TerminalEnvironment, TerminalTask

KEYS = range(10, 100)
HELDOUT_EVERY = 5
MISTAKE_RATE = 0.75
# The shell alone, described in a few words: a tiny model's context is short. The episode ends
# with a reply that calls no tool.
TOOLS = [string_tool("bash", "Run a command.", command="the command")]


class LookupTask(TerminalTask):
    type: Literal["lookup"] = "lookup"  # type: ignore[assignment]
    start: int = Field(ge=10, le=99)
    hops: int = Field(ge=1, le=8)
    mapping: dict[int, int]
    """The permutation the files under notes/ hold."""
    answer: int


class _Result:
    """What `format_exec` needs of an exec result (the solver knows it without running it)."""

    def __init__(self, stdout: str, exit_code: int = 0, stderr: str = "") -> None:
        self.stdout, self.stderr, self.exit_code, self.timed_out = stdout, stderr, exit_code, False


def shown(res) -> str:
    """A command's result as the model sees it: its output alone when it succeeded (a tiny
    model's context is short), else the exit code and both streams."""
    return res.stdout.strip() if res.exit_code == 0 and not res.stderr else format_exec(res)


def follow(mapping: dict[int, int], start: int, hops: int) -> list[int]:
    values, key = [], start
    for _ in range(hops):
        key = mapping[key]
        values.append(key)
    return values


def split_of(start: int, mapping: dict[int, int]) -> str:
    digest = hashlib.sha256(f"{start}:{sorted(mapping.items())}".encode()).digest()
    return "heldout" if int.from_bytes(digest[:8], "big") % HELDOUT_EVERY == 0 else "train"


def make_task(rng: random.Random, task_id: str, hops: int) -> LookupTask:
    values = list(KEYS)
    rng.shuffle(values)
    mapping = dict(zip(KEYS, values))
    start = rng.choice(list(KEYS))
    answer = follow(mapping, start, hops)[-1]
    return LookupTask(
        id=task_id, description=f"Start at {start}: cat notes/{start}, then the file it names, "
        f"{hops} times; write the last number to answer.txt.",
        files={f"notes/{k}": f"{v}\n" for k, v in mapping.items()},
        test_script=f'test "$(cat answer.txt)" = {answer}', start=start, hops=hops,
        mapping=mapping, answer=answer, command_timeout_seconds=10, timeout_seconds=10)


class LookupEnvironment(TerminalEnvironment):
    type = "lookup"
    task_model = LookupTask

    def generate_tasks(self, gen) -> list[LookupTask]:
        """`gen.count` tasks of `gen.split` with `gen.num_steps` lookups each, the same for the
        same seed."""
        if not 1 <= gen.num_steps <= 8:
            raise ValueError(f"num_steps: a lookup task takes 1..8 lookups, got {gen.num_steps}")
        rng = random.Random(f"lookup/{gen.seed}/{gen.num_steps}")
        tasks: list[LookupTask] = []
        while len(tasks) < gen.count:
            task = make_task(rng, f"lookup-{gen.split}-{gen.seed}-{len(tasks)}", gen.num_steps)
            if split_of(task.start, task.mapping) == gen.split:
                tasks.append(task)
        return tasks

    def system_prompt(self, task: LookupTask) -> str:
        return ""

    async def call_tool(self, sandbox: SandboxHandle, task: LookupTask, call: ToolCall) -> ToolResult:
        if call.name != "bash":
            return await super().call_tool(sandbox, task, call)
        command = call.arguments.get("command")
        if not isinstance(command, str) or not command.strip():
            return ToolResult("error: bash needs a non-empty string argument `command`")
        return ToolResult(shown(await sandbox.exec(command, timeout=task.command_timeout_seconds)))

    def tools(self, task: LookupTask) -> list[ToolSpec]:
        return TOOLS

    def demonstrate(self, task: LookupTask, rng: random.Random) -> list[AssistantTurn]:
        turns, current = [], str(task.start)
        for _ in range(task.hops):
            key = int(current)
            # What `cat` prints, as the sandbox would show it (the test plays these for real).
            result = (_Result(f"{task.mapping[key]}\n") if key in task.mapping else
                      _Result("", 1, f"cat: notes/{key}: No such file or directory\n"))
            turns.append(AssistantTurn(tool_calls=[ToolCall("bash", {"command": f"cat notes/{key}"})],
                                       outputs=[shown(result)]))
            observed = str(task.mapping.get(key, current))
            current = observed[:-1] if (len(observed) > 1 and observed.endswith("0")
                                        and rng.random() < MISTAKE_RATE) else observed
        write = f"echo {current} > answer.txt"
        turns.append(AssistantTurn(tool_calls=[ToolCall("bash", {"command": write})],
                                   outputs=[shown(_Result(""))]))
        turns.append(AssistantTurn(content="Done."))
        return turns

    def grade_demonstration(self, task: LookupTask, turns: list[AssistantTurn]) -> Grade:
        """The solver's written number against the answer, as the test script would judge it."""
        write = turns[-2].tool_calls[0].arguments["command"]
        written = write.removeprefix("echo ").removesuffix(" > answer.txt")
        ok = written == str(task.answer)
        return Grade(float(ok), {"tests_passed": float(ok)}, f"wrote {written}, expected {task.answer}")

    def tokenizer_words(self, tasks) -> list[str]:
        """Every number a token: a copy is then one token from a fixed distance back, which a
        two-layer model learns within a few hundred steps whatever its seed (digit by digit it
        often stalled halfway, copying one digit of the two)."""
        return [str(k) for k in KEYS]

    def tokenizer_corpus(self, tasks) -> list[str]:
        """The prompts and tools, and the scripted episodes' calls and outputs."""
        texts = super().tokenizer_corpus(tasks)
        rng = random.Random(1)
        for task in tasks[:500]:
            texts += [o for turn in self.demonstrate(task, rng) for o in turn.outputs or []]
        return texts
