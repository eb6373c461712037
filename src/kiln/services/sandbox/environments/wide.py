"""`wide` and `wide-lookup`: wide search for agent swarms, built on `lookup`'s files.

A `wide` task: the files under notes/ hold a permutation of 10..99, as in `lookup`; the task
names K start numbers, and the answer is where each one's chain ends after `hops` lookups, in
the order given. The orchestrator has no shell: it can only hand each chain to a subagent
(`kiln.swarm`'s `assign` and `wait`; `assign next` hands over the chain after those handed out
so far, `assign 2` the second start's), wait for the ends and answer with them.

    <task>ends of 37 52 18, 2 hops</task>
    <call>assign next</call>  <obs>s1</obs>  <call>wait all</call>  <obs>s1: 10</obs>
    <call>assign next</call>  <obs>s2</obs>  <call>wait all</call>  <obs>s1: 10, s2: 64 (a line each)</obs>  ...
    <answer>s1: 10
    s2: 64
    s3: 33</answer>

`wait all` lists every answer so far, so the answer copies the last observation whether the
chains ran one per wait or all before one (the grader skips the board's `sK:` labels; bare
ends in order are right too). `next` keeps that true: the k-th assignment takes the k-th chain,
so the board lists the ends in order however the assignments and waits interleave. The
scripted orchestrator assigns `next`, one chain per wait: with places instead, a serial model's
place follows the count of its waits, which assigning twice before a wait breaks.

A sub-task (`subtask`: the text assigned is `next` or a chain's place, 1..K) is a
`wide-lookup` task: one chain, in the same files, followed with the shell and answered in a
reply.

    <task>end of 37, 2 hops</task>
    <call>bash cat notes/37</call>  <obs>82</obs>  <call>bash cat notes/82</call>  <obs>10</obs>
    <answer>10</answer>

`wide-lookup` task sets train the subagents' checkpoint; `wide` ones the orchestrator. The
scripted orchestrator is serial (assign one chain, wait, assign the next): parallelism has to
come from RL. After a wait it now and then waits once more (`RECHECK`), nothing running, and
sees the same board: so its answer follows a full board, not a count of waits, and a policy
taught by it answers after a parallel schedule's board too. The scripted subagent makes no
mistakes. Both are graded on the answer alone: 1 when every end is right, with the fraction
right in `ends_correct`.

Train and held-out tasks are told apart as `lookup`'s are, by a hash of the map and starts.
"""
from __future__ import annotations

import random
import re
from typing import Literal

from pydantic import Field

from kiln import swarm
from kiln.env import AssistantTurn, Grade, SandboxHandle, ToolCall, ToolResult, ToolSpec
from .lookup import KEYS, TOOLS as SHELL, LookupEnvironment, follow, split_of

HOPS = 2
#: How often the scripted orchestrator waits again on a board with nothing running.
RECHECK = 0.25
#: `assign next`: the chain after those handed out so far.
NEXT = "next"
_LABEL = re.compile(r"s\d+:")


class WideTask(LookupEnvironment.task_model):
    type: Literal["wide"] = "wide"  # type: ignore[assignment]
    starts: list[int] = Field(min_length=1, max_length=8)
    ends: list[int]
    start: int = 0  # type: ignore[assignment]
    answer: int = 0


class WideLookupTask(WideTask):
    type: Literal["wide-lookup"] = "wide-lookup"  # type: ignore[assignment]
    starts: list[int] = Field(min_length=1, max_length=1)


def _ends(task: WideTask) -> str:
    return " ".join(str(e) for e in task.ends)


def _enumerated(name: str, argument: str, values: list[str]) -> ToolSpec:
    """The swarm tool `name` taking `argument` alone, limited to `values`."""
    tool = next(t for t in swarm.TOOLS if t.name == name)
    prop = tool.parameters["properties"][argument]
    return ToolSpec(name, tool.description, {"type": "object", "required": [argument],
                                             "properties": {argument: {**prop, "enum": values}}})


def make_task(rng: random.Random, task_id: str, width: int, hops: int = HOPS,
              cls: type[WideTask] = WideTask) -> WideTask:
    values = list(KEYS)
    rng.shuffle(values)
    mapping = dict(zip(KEYS, values))
    starts = rng.sample(list(KEYS), width)
    ends = [follow(mapping, s, hops)[-1] for s in starts]
    if cls is WideLookupTask:
        text = f"end of {starts[0]}, {hops} hops"
    else:
        text = f"ends of {' '.join(map(str, starts))}, {hops} hops"
    return cls(id=task_id, description=text, files={f"notes/{k}": f"{v}\n" for k, v in mapping.items()},
               test_script="true", starts=starts, ends=ends, hops=hops, mapping=mapping,
               command_timeout_seconds=10, timeout_seconds=10)


class WideEnvironment(LookupEnvironment):
    type = "wide"
    task_model = WideTask
    #: The width (chains per task) is the task generator's `numSteps`.
    width_from_steps = True

    def generate_tasks(self, gen) -> list[WideTask]:
        width = gen.num_steps if self.width_from_steps else 1
        if not 1 <= width <= 8:
            raise ValueError(f"num_steps: a wide task has 1..8 chains, got {width}")
        cls = WideTask if self.width_from_steps else WideLookupTask
        rng = random.Random(f"{self.type}/{gen.seed}/{width}")
        tasks: list[WideTask] = []
        while len(tasks) < gen.count:
            task = make_task(rng, f"{self.type}-{gen.split}-{gen.seed}-{len(tasks)}", width, cls=cls)
            if split_of(sum(task.starts), task.mapping) == gen.split:
                tasks.append(task)
        return tasks

    def load_tasks(self, records):
        return [(WideLookupTask if r.get("type") == "wide-lookup" else WideTask).model_validate(r)
                for r in records]

    def tools(self, task: WideTask) -> list[ToolSpec]:
        if isinstance(task, WideLookupTask):
            return SHELL
        # The values each argument can take are listed in its schema, so that a call is
        # checked against them and rollout can sample among them alone
        # (`sampling.toolChoiceTemperature`): `assign` takes `next` or a chain's place, `wait`
        # `all` or a subagent's name (one per chain). A new subagent per assignment, so no
        # `create_subagent`, and `assign` names none.
        width = len(task.starts)
        return [_enumerated(swarm.ASSIGN, "task", [NEXT] + [str(k) for k in range(1, width + 1)]),
                _enumerated(swarm.WAIT, "subagents", ["all"] + [f"s{k}" for k in range(1, width + 1)])]

    def subtask(self, task: WideTask, role: str, instructions: str, assigned: str, *,
                index: int = 0) -> WideTask:
        # A sub-task is named by its place in the task (`assign 2`: the second start's chain),
        # or is `next`: the chain after those handed out so far, so that the k-th assignment of
        # an episode takes the k-th chain and the results board lists the ends in order. What
        # the subagent sees is that chain alone.
        text = assigned.strip()
        if text == NEXT:
            if index >= len(task.starts):
                raise ValueError(f"every chain of this task has been handed out ({len(task.starts)})")
            k = index + 1
        else:
            try:
                k = int(text)
            except ValueError:
                k = 0
        if not 1 <= k <= len(task.starts):
            raise ValueError(f"{text!r} is not one of this task's chains "
                             f"(1..{len(task.starts)}, or {NEXT})")
        start = task.starts[k - 1]
        end = task.ends[k - 1]
        return WideLookupTask(
            id=f"{task.id}/{start}", description=f"end of {start}, {task.hops} hops",
            files=task.files, test_script="true", starts=[start], ends=[end], hops=task.hops,
            mapping=task.mapping, command_timeout_seconds=task.command_timeout_seconds,
            timeout_seconds=task.timeout_seconds)

    async def call_tool(self, sandbox: SandboxHandle, task: WideTask, call: ToolCall) -> ToolResult:
        if not isinstance(task, WideLookupTask):
            # The swarm tools run in rollout; anything reaching here is not one of them.
            return ToolResult(f"error: {call.name!r} is not run by this environment "
                              f"(tools: {', '.join(swarm.TOOL_NAMES)}, answered by rollout)")
        return await super().call_tool(sandbox, task, call)

    async def grade(self, sandbox: SandboxHandle | None, task: WideTask, answer: str | None) -> Grade:
        return self._grade(task, answer)

    def _grade(self, task: WideTask, answer: str | None) -> Grade:
        # The ends in order, bare (`10 64 33`) or as the results board's lines (`s1: 10` ...):
        # the board's labels are skipped.
        got = [w for w in (answer or "").split() if not _LABEL.fullmatch(w)]
        right = sum(1 for i, e in enumerate(task.ends) if i < len(got) and got[i] == str(e))
        ok = right == len(task.ends) and len(got) == len(task.ends)
        return Grade(float(ok), {"ends_correct": right / len(task.ends)},
                     f"answered {answer!r}, expected {_ends(task)!r}")

    def demonstrate(self, task: WideTask, rng: random.Random) -> list[AssistantTurn]:
        if isinstance(task, WideLookupTask):
            turns, key = [], task.starts[0]
            for value in follow(task.mapping, key, task.hops):
                turns.append(AssistantTurn(tool_calls=[ToolCall("bash", {"command": f"cat notes/{key}"})],
                                           outputs=[str(value)]))
                key = value
            return turns + [AssistantTurn(content=str(key))]
        def wait(board: str) -> AssistantTurn:
            return AssistantTurn(tool_calls=[ToolCall(swarm.WAIT, {"subagents": "all"})], outputs=[board])

        turns, board = [], ""
        for i in range(1, len(task.ends) + 1):
            turns.append(AssistantTurn(tool_calls=[ToolCall(swarm.ASSIGN, {"task": NEXT})],
                                       outputs=[f"s{i}"]))
            # `wait all` shows every answer collected so far (rollout's results board).
            board = "\n".join(f"s{j}: {e}" for j, e in enumerate(task.ends[:i], 1))
            turns.append(wait(board))
            # Now and then the board is looked at once more (nothing is running; the same
            # board comes back), so that the count of waits does not tell when to answer:
            # the board does, as it would after chains handed out several at a time.
            if rng.random() < RECHECK:
                turns.append(wait(board))
        # The answer is the last board as it stands: a verbatim copy, which a tiny model learns
        # reliably, where picking the ends out from between the labels stalled its SFT.
        return turns + [AssistantTurn(content=board)]

    def grade_demonstration(self, task: WideTask, turns: list[AssistantTurn]) -> Grade:
        return self._grade(task, turns[-1].content)

    def tokenizer_words(self, tasks) -> list[str]:
        return super().tokenizer_words(tasks) + [f"s{i}" for i in range(1, 9)] + ["all", NEXT]


class WideLookupEnvironment(WideEnvironment):
    """Single chains answered in a reply: what a `wide` task's subagents play."""

    type = "wide-lookup"
    task_model = WideLookupTask
    width_from_steps = False
