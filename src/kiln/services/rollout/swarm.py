"""Swarm episodes: the orchestrator's tools run here, its subagents on a frozen engine.

An orchestrator episode is an ordinary `run_episode` on the trained engine whose environment is
wrapped in `SwarmEnv`: a reply that calls `create_subagent`, `assign` or `wait`
(`kiln.swarm`) is answered here, every other reply goes to the environment as it would. An
`assign` opens the sub-task in the environment (`EnvClient.open_subtask`: the environment makes
it from the orchestrator's task and the text assigned, in a sandbox of its own) and plays it as
a subagent episode, in the background, on the `Subagents`' engine: a checkpoint pinned for the
whole job, never updated by weight sync (a subagent token of another version fails the episode:
the deployment was not frozen). The subagent sees its sub-task and tools alone, never the
orchestrator's context, and hands back only its final answer, which `wait` puts into the
orchestrator's context as an observation; the orchestrator's trajectory is the only one
shipped, so nothing a subagent wrote is trained on. Subagents cannot create subagents (depth 1:
the swarm tools are taken off their tool lists).

A training episode held to a critical-path budget (`SwarmSettings.max_critical_steps`) ends,
with no answer, before the orchestrator call that would pass it (`SwarmEnv._deadline`); one
held to its limits (`SwarmSettings.end_on_refusal`), at the first assignment they refuse.
When the orchestrator's episode is closed, subagents still running are cancelled, and the
reward becomes PARL's (`kiln.swarm.Parl`, `SwarmEnv.rewarded`) with every part, and the
episode's measurements (subagents, critical-path and total steps, wall time), in
`reward_parts`.

Not covered: a swarm stage's schedules and its place in the producer (`swarm_run.py`, an
episode extension), the sub-tasks themselves (the environment).
"""
from __future__ import annotations

import asyncio
import dataclasses
import time
from dataclasses import dataclass, field

from kiln.episode import Action, EpisodeInfo, StepResult, ToolOutput
from kiln.env import ToolCall, ToolSpec
from kiln.services.rollout.agent import Limits, run_episode
from kiln.services.rollout.engine import Engine, SamplingOptions
from kiln.services.rollout.formats import Format
from kiln.services.sandbox.client import EnvClient
from kiln.swarm import ASSIGN, CREATE, TOOL_NAMES, Parl, SwarmStats, replies_mask
from kiln.trajectory import Trajectory


class SubagentNotFrozen(RuntimeError):
    """A subagent's tokens came from another policy version than the pinned one: the subagents'
    engine received weights it must never receive. Not retryable; fix the deployment."""


@dataclass
class Subagents:
    """The frozen engine subagents run on, and what bounds them."""

    engine: Engine
    fmt: Format
    sampling: SamplingOptions
    limits: Limits
    max_per_episode: int = 8
    version: int = field(init=False)
    """The pinned policy version; every subagent token must carry it."""

    def __post_init__(self) -> None:
        self.version = self.engine.policy_version


@dataclass
class _Subagent:
    name: str
    role: str
    instructions: str = ""
    task: asyncio.Task | None = None
    assigned_at: int = 0
    assignment: int = -1
    """The episode's count of assignments when its current sub-task was assigned (its id)."""
    collected: bool = True
    output: str | None = None
    """What its last collected sub-task handed back."""


class _Subtask:
    """The `EnvClient` a subagent episode sees: `open` opens its sub-task, and each step is one
    of its model calls (counted) whose final answer is kept."""

    def __init__(self, env: EnvClient, parent: str, agent: _Subagent, task: str) -> None:
        self.env, self.parent, self.agent, self.task = env, parent, agent, task
        self.calls, self.answer, self.result = 0, None, StepResult()

    async def open(self, task_set: str, index: int, max_actions: int) -> EpisodeInfo:
        info = await self.env.open_subtask(self.parent, self.agent.role, self.agent.instructions,
                                           self.task, max_actions)
        return dataclasses.replace(info, tools=[t for t in info.tools if t.name not in TOOL_NAMES])

    async def step(self, episode_id: str, action: Action) -> StepResult:
        self.calls += 1
        result = await self.env.step(episode_id, action)
        if result.done:
            if not action.tool_calls and not action.unparseable:
                self.answer = action.content
            self.result = result
        return result

    async def close(self, episode_id: str) -> None:
        await self.env.close(episode_id)


class SwarmEnv:
    """One orchestrator episode's environment: the job's, plus the swarm tools. One per episode
    (it holds the episode's subagents)."""

    def __init__(self, env: EnvClient, subagents: Subagents, parl: Parl,
                 budget: int | None = None, end_on_refusal: bool = False,
                 credit: str = "episode", withdraw: bool = False) -> None:
        self.env, self.subagents, self.parl, self.budget = env, subagents, parl, budget
        self.end_on_refusal, self.credit, self.withdraw = end_on_refusal, credit, withdraw
        self._tools: list[ToolSpec] = []
        """The episode's tools, as the environment lists them."""
        self._assigning: set[int] = set()
        """The orchestrator's replies (0-based) that started a subagent."""
        self.stats = SwarmStats()
        self._agents: dict[str, _Subagent] = {}
        self._running: set[int] = set()
        """The assignments (ids) outstanding: assigned, and their answer not yet collected by a
        `wait`. Counted in the episode's own order of calls, not in wall-clock time, so that
        r_parallel does not depend on how fast a subagent happened to finish."""
        self._overlaps: list[frozenset[int]] = []
        """The outstanding set each time it grew: who ran side by side."""
        self._collected: set[int] = set()
        """The assignments whose output a `wait` brought into the orchestrator's context."""
        self._episode = ""
        self._t0 = 0.0

    async def task_sets(self):
        return await self.env.task_sets()

    async def open(self, task_set: str, index: int, max_actions: int) -> EpisodeInfo:
        self._t0 = time.monotonic()
        info = await self.env.open(task_set, index, max_actions)
        self._episode, self._tools = info.episode_id, list(info.tools)
        return info

    async def close(self, episode_id: str) -> None:
        try:
            await self._cancel_running()
        finally:
            await self.env.close(episode_id)

    async def step(self, episode_id: str, action: Action) -> StepResult:
        depth = self.stats.path.orchestrator_call()
        swarm = [c for c in action.tool_calls if c.name in TOOL_NAMES]
        if action.unparseable or not swarm:
            result = await self.env.step(episode_id, action)
            return self._scored(result) if result.done else self._deadline() or self._offer(result)
        outputs: list[ToolOutput] = []
        others = [c for c in action.tool_calls if c.name not in TOOL_NAMES]
        if others:
            # A reply mixing both kinds (formats with several calls per reply): the
            # environment's calls run first, as one step.
            result = await self.env.step(episode_id, Action(others, action.content))
            if result.done:
                return self._scored(result)
            outputs += result.outputs
        refused = self.stats.refused
        for call in swarm:
            outputs.append(ToolOutput(call.id, call.name, await self._tool(call, depth)))
            if self.end_on_refusal and self.stats.refused > refused:
                return self._ended(outputs[-1].content, "refused")
        return self._deadline() or self._offer(StepResult(outputs=outputs))

    def _offer(self, result: StepResult) -> StepResult:
        """`result`, with the tools offered from now on when the job withdraws `assign` (and
        `create_subagent`) at the subagent limit: once no subagent can be created, and none
        that the episode could name is idle, an assignment can only be refused."""
        if not self.withdraw:
            return result
        withdrawn: set[str] = set()
        if self._over_limit():
            assign = next((t for t in self._tools if t.name == ASSIGN), None)
            nameable = assign is not None and "subagent" in assign.parameters.get("properties", {})
            idle = any(a.task is None or a.collected for a in self._agents.values())
            withdrawn = {CREATE} if nameable and idle else {CREATE, ASSIGN}
        result.tools = [t.name for t in self._tools if t.name not in withdrawn]
        return result

    def _deadline(self) -> StepResult | None:
        """The episode's end when its next orchestrator call would pass the critical-path
        budget: ended before that call is generated, so the move that spent the budget (a
        wait, typically) is what the reward answers for, never a right answer given late."""
        if self.budget is None or self.stats.path.context + 1 <= self.budget:
            return None
        self.stats.over_budget = True
        return self._ended(f"no answer within {self.budget} critical-path steps",
                           "critical_path_budget")

    def _ended(self, why: str, flag: str) -> StepResult:
        """The episode's end, unanswered (r_perf 0), for `why`."""
        self.stats.wall_seconds = time.monotonic() - self._t0
        return StepResult(done=True, reward=0.0, reward_parts={"answered": 0.0},
                          verifier_output=why, flags=[flag])

    # ------------------------------------------------------------------ tools
    async def _tool(self, call: ToolCall, depth: int) -> str:
        args = {k: str(v).strip() for k, v in call.arguments.items()}
        if call.name == CREATE:
            return self._create(args.get("role", ""), args.get("instructions", ""))
        if call.name == ASSIGN:
            return self._assign(args.get("task", ""), args.get("subagent", ""), depth)
        return await self._wait(args.get("subagents", ""))

    def _over_limit(self) -> str:
        """The refusal of one more subagent, or "" while the episode may create one."""
        if len(self._agents) >= self.subagents.max_per_episode:
            return (f"error: this episode may create at most {self.subagents.max_per_episode} "
                    "subagents")
        return ""

    def _create(self, role: str, instructions: str) -> str:
        if refusal := self._over_limit():
            return refusal
        name = f"s{len(self._agents) + 1}"
        self._agents[name] = _Subagent(name, role or "worker", instructions)
        self.stats.subagents += 1
        return name

    def _assign(self, task: str, name: str, depth: int) -> str:
        refusal = self._refusal(task, name)
        if refusal:
            # A refused assignment is a sub-task asked for and never done: r_finish counts it
            # (`SwarmStats.refused`), so that assigning past the limit costs, not only a turn.
            self.stats.refused += 1
            return refusal
        if not name:
            name = self._create("worker", "")
        agent = self._agents[name]
        agent.assigned_at, agent.collected = depth, False
        agent.assignment = self.stats.assigned
        agent.task = asyncio.ensure_future(self._play(agent, task))
        self.stats.assigned += 1
        self._assigning.add(self.stats.path.orchestrator_calls - 1)
        self._running.add(agent.assignment)
        self._overlaps.append(frozenset(self._running))
        self.stats.peak = max(self.stats.peak, len(self._running))
        return name

    def _refusal(self, task: str, name: str) -> str:
        """Why `assign(task, name)` is refused, or "" when it can run."""
        if not task:
            return "error: assign needs a non-empty `task`"
        if not name:
            return self._over_limit()
        agent = self._agents.get(name)
        if agent is None:
            return f"error: no subagent {name!r} (created: {', '.join(self._agents) or 'none'})"
        if agent.task is not None and not agent.collected:
            return f"error: {name} is still on its last task; wait for it first"
        return ""

    async def _play(self, agent: _Subagent, task: str) -> tuple[str, int, bool]:
        """(what the subagent hands back, its model calls, whether it completed its sub-task)."""
        sub = _Subtask(self.env, self._episode, agent, task)
        s = self.subagents
        try:
            trajs = await run_episode(s.engine, sub, s.fmt, task_set="", index=0,
                                      sampling=s.sampling, limits=s.limits)
            versions = {span.policy_version for t in trajs for span in t.version_spans}
            if versions - {s.version}:
                raise SubagentNotFrozen(
                    f"subagent tokens of versions {sorted(versions)}; the subagents' engine is "
                    f"pinned to version {s.version} and must never be updated")
            if sub.answer is None:
                return "no answer", sub.calls, False
            return sub.answer, sub.calls, sub.result.reward >= 0.5
        except SubagentNotFrozen:
            raise
        except Exception as exc:  # the subagent's failure is the orchestrator's observation
            return f"error: {type(exc).__name__}: {exc}", sub.calls, False

    async def _wait(self, names: str) -> str:
        """`wait s1 s2`: those subagents' answers. `wait all` (or nothing named): wait for every
        running subagent, then list every answer collected so far, in creation order, the
        earlier ones included: the results board. So the observation an answer is read from
        has the same form however the sub-tasks were scheduled (all four after one wait, or one
        per wait), and combining them is a copy of the last observation. With none running it
        shows the board as it stands: an error only when nothing has answered yet."""
        pending = [a for a in self._agents.values() if a.task is not None and not a.collected]
        board = not names or names == "all"
        if not board:
            wanted = [n for n in names.replace(",", " ").split()]
            unknown = [n for n in wanted if n not in self._agents]
            if unknown:
                return f"error: no subagent {', '.join(unknown)}"
            idle = [n for n in wanted if n not in {a.name for a in pending}]
            if idle:
                return f"error: {', '.join(idle)} has no task to wait for"
            pending = [self._agents[n] for n in wanted]
        if not pending and not (board and any(a.output is not None for a in self._agents.values())):
            return "error: no subagent is working"
        for agent in pending:
            output, calls, finished = await agent.task
            agent.collected, agent.output = True, output
            self._collected.add(agent.assignment)
            self._running.discard(agent.assignment)
            self.stats.path.observed(self.stats.path.subagent_done(agent.assigned_at, calls))
            self.stats.finished += finished
        shown = [a for a in self._agents.values() if a.output is not None] if board else pending
        return "\n".join(f"{a.name}: {a.output}" for a in shown)

    async def _cancel_running(self) -> None:
        # Finished ones are gathered too: one that failed where no wait read it (a wait raised
        # on another's SubagentNotFrozen first) would otherwise hold an exception that no one
        # retrieves, which asyncio reports when the task is collected, at an arbitrary point.
        tasks = [a.task for a in self._agents.values() if a.task is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # ----------------------------------------------------------------- reward
    def _scored(self, result: StepResult) -> StepResult:
        if result.done:
            self.stats.wall_seconds = time.monotonic() - self._t0
        return result

    def rewarded(self, trajs: list[Trajectory]) -> list[Trajectory]:
        """The episode's trajectories with PARL's reward, its parts and the measurements. An
        episode that ran out of turns has the environment's "no answer" reward (0) as r_perf."""
        if not self.stats.wall_seconds:
            self.stats.wall_seconds = time.monotonic() - self._t0
        # Of each set of subagents that ran side by side, those whose answers a wait brought
        # back (`parallelReward: collected` counts no others).
        self.stats.peak_collected = max(
            (len(running & self._collected) for running in self._overlaps), default=0)
        for t in trajs:
            parts = self.parl.reward(t.reward, self.stats.peak,
                                     self.stats.assigned + self.stats.refused, self.stats.finished,
                                     peak_collected=self.stats.peak_collected)
            t.reward = parts["parl/total"]
            t.reward_parts = {**t.reward_parts, **parts, **self.stats.parts()}
            if self.credit == "assignments":
                # The lambda-weighted r_parallel and r_finish, to the replies that assigned.
                t.shaping_reward = t.reward - parts["parl/perf"]
                t.shaping_mask = replies_mask(t, self._assigning, self.stats.path.orchestrator_calls)
        return trajs


async def run_swarm_episode(engine: Engine, env: EnvClient, fmt: Format, subagents: Subagents,
                            parl: Parl, *, wrap=None, budget: int | None = None,
                            end_on_refusal: bool = False, credit: str = "episode",
                            withdraw: bool = False, **kwargs) -> list[Trajectory]:
    """`run_episode` (same arguments) of an orchestrator: the swarm tools answered, subagents
    played on `subagents`' engine (on `env` itself), the reward PARL's. `wrap` wraps the
    orchestrator's environment (the producer's occupancy timer: an orchestrator waiting on its
    subagents is stepping, not occupying the engine); `budget`, the critical-path steps it may
    take (`SwarmSettings.max_critical_steps`); `end_on_refusal`, whether an assignment its
    limits refuse ends it (`SwarmSettings.end_on_refusal`); `credit`, which replies the shaping
    terms are credited to (`SwarmSettings.shaping_credit`); `withdraw`, whether `assign` leaves
    the offered tools at the subagent limit (`SwarmSettings.withdraw_at_limit`)."""
    swarm = SwarmEnv(env, subagents, parl, budget, end_on_refusal, credit, withdraw)
    played = await run_episode(engine, wrap(swarm) if wrap else swarm, fmt, **kwargs)
    return swarm.rewarded(played)

