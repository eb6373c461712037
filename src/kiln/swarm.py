"""Agent swarms, the parts every floor shares: the orchestrator's tools, the critical path and
the PARL reward (Kimi K2.5).

A trainable orchestrator splits its task among subagents that run a frozen checkpoint, each in
its own context with its own tools; what a subagent returns enters the orchestrator's context as
an observation (never trained on). The orchestrator's tools:

    create_subagent(role, instructions)  a new idle subagent; returns its name (`s1`, `s2`, ...)
    assign(task, subagent)               give a subagent a sub-task and return at once; without
                                         `subagent`, a new one is created for it
    wait(subagents)                      block until the named subagents finish; returns each
                                         one's final output. `all` (or empty) waits for every
                                         one running and returns every output collected so
                                         far, earlier ones included (the results board)

An environment offers these tools in its tasks' tool lists (so its tokenizer and its scripted
solutions know them); rollout runs them (`kiln.services.rollout.swarm`), the environment makes
each sub-task (`Environment.subtask`).

Latency is counted on the critical path: the longest chain of dependent model calls. An
orchestrator call depends on the one before it and on every subagent output already in its
context; a subagent's first call depends on the orchestrator call that assigned it. Serial
use (assign, wait, assign, wait, ...) puts every subagent call on the path; assigning all
sub-tasks before one wait puts only the longest one on it.

The reward: `r = lambda_parallel * r_parallel + lambda_finish * r_finish + r_perf`, where
- `r_parallel = min(peak, target) / target`: the most subagents running at once, against a
  target (the episode's subagent limit unless the job sets one); it pays for instantiating
  subagents side by side, against collapse into one serial agent. "At once" is in the
  episode's own order of calls: a subagent runs from the call that assigned it to the `wait`
  that collects its answer, however soon it finished in wall-clock time, so the peak is a
  function of what the orchestrator did (serial use, assign then wait, gives 1; assigning k
  before one wait gives k), never of timing;
- `r_finish`: the fraction of assigned sub-tasks that were really completed (the subagent
  answered and its sub-task's verifier passed), against spawning many useless subagents; an
  assignment the tool refused (past the subagent limit) counts as one not completed; 0 when
  nothing was assigned;
- `r_perf`: the task's own reward.
A job may pay r_parallel only for what the episode achieved (`parallelReward: outcome`): it is
scaled by r_perf clipped to [0, 1], so a wrong answer earns none of it, however parallel its
way there, and a right one earns it in full. Or only for subagents whose answers the
orchestrator read (`parallelReward: collected`): the peak counts those running at once that a
`wait` later collected, so assigning everything and answering without waiting earns none of
it. r_finish needs no such scale: it pays sub-tasks that were really completed, and it is
what charges an assignment refused past the limit (an episode that never answers would
otherwise lose nothing by assigning forever). Both lambdas anneal linearly to 0 over the
stage (`anneal`), so that late in training only the outcome counts. A stage may also hold its
training episodes to a latency budget in critical-path steps
(`SwarmSettings.max_critical_steps`): one that would pass it ends with no answer, so r_perf
pays only the answers that came in time.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kiln.env import ToolSpec
from kiln.trajectory import Trajectory

CREATE, ASSIGN, WAIT = "create_subagent", "assign", "wait"

TOOLS = [
    ToolSpec(CREATE, "Create a subagent; returns its name.", {
        "type": "object", "required": ["role"],
        "properties": {"role": {"type": "string", "description": "what the subagent is for"},
                       "instructions": {"type": "string", "description": "its standing orders"}}}),
    ToolSpec(ASSIGN, "Give a sub-task to a subagent (a new one when none is named); returns at "
             "once with the subagent's name.", {
                 "type": "object", "required": ["task"],
                 "properties": {"task": {"type": "string", "description": "the sub-task"},
                                "subagent": {"type": "string", "description": "its name"}}}),
    ToolSpec(WAIT, "Wait for subagents to finish; returns what each one answered (`all`: "
             "every answer so far).", {
        "type": "object", "required": ["subagents"],
        "properties": {"subagents": {"type": "string",
                                     "description": "names, or `all` for every one running"}}}),
]
TOOL_NAMES = frozenset(t.name for t in TOOLS)


@dataclass
class CriticalPath:
    """Counts an episode's model calls and the longest chain of dependent ones."""

    context: int = 0
    """The depth of the deepest call whose result is in the orchestrator's context."""
    orchestrator_calls: int = 0
    subagent_calls: int = 0
    length: int = 0

    def orchestrator_call(self) -> int:
        """One orchestrator call; its depth (the depth an assignment starts from)."""
        self.orchestrator_calls += 1
        self.context += 1
        self.length = max(self.length, self.context)
        return self.context

    def subagent_done(self, assigned_at: int, calls: int) -> int:
        """A subagent that made `calls` calls after being assigned at depth `assigned_at`: the
        depth of its output."""
        self.subagent_calls += calls
        depth = assigned_at + calls
        self.length = max(self.length, depth)
        return depth

    def observed(self, depth: int) -> None:
        """A result of depth `depth` entered the orchestrator's context."""
        self.context = max(self.context, depth)

    @property
    def total(self) -> int:
        return self.orchestrator_calls + self.subagent_calls


@dataclass(frozen=True)
class Parl:
    """The PARL reward's weights, already annealed to the current step."""

    lambda_parallel: float
    lambda_finish: float
    target: int
    paid: str = "always"
    """How r_parallel is paid (`SwarmSettings.parallel_reward`): `always`; `outcome`, scaled by
    r_perf clipped to [0, 1]; `collected`, counting the subagents whose answers were read."""

    def reward(self, r_perf: float, peak: int, assigned: int, finished: int,
               peak_collected: int | None = None) -> dict[str, float]:
        """The reward's parts (`parl/...`) and total (`parl/total`). `peak`: the most subagents
        running at once; `peak_collected`: the most of those whose answers a `wait` then
        collected (what `collected` counts). The parts are the terms before their weights and
        before the outcome scale (`parl/outcome_scale`), so that a run's report shows what the
        episode did, not only what it was paid."""
        if self.target < 1:
            raise ValueError(f"the parallelism target is {self.target}; it must be at least 1")
        if self.paid == "collected":
            if peak_collected is None:
                raise ValueError("r_parallel paid for collected subagents needs peak_collected")
            peak = peak_collected
        r_parallel = min(peak, self.target) / self.target
        r_finish = finished / assigned if assigned else 0.0
        scale = min(max(r_perf, 0.0), 1.0) if self.paid == "outcome" else 1.0
        total = self.lambda_parallel * scale * r_parallel + self.lambda_finish * r_finish + r_perf
        return {"parl/parallel": r_parallel, "parl/finish": r_finish, "parl/perf": r_perf,
                "parl/lambda_parallel": self.lambda_parallel,
                "parl/lambda_finish": self.lambda_finish, "parl/outcome_scale": scale,
                "parl/total": total}


def replies_mask(traj: Trajectory, replies: set[int], calls: int) -> list[int]:
    """A per-token mask of `traj` that is 1 on the orchestrator's `replies` (0-based) of the
    `calls` it made: what `shapingCredit: assignments` credits the shaping terms to."""
    spans = traj.reply_spans()
    if len(spans) != calls:
        # Each orchestrator call is one reply in one context; a context restarted between
        # turns (turn-level thinking) has its replies in several trajectories.
        raise ValueError(f"shapingCredit 'assignments': trajectory {traj.id} has {len(spans)} "
                         f"replies, the orchestrator made {calls} calls; the credit needs the "
                         "whole episode in one context")
    mask = [0] * len(traj.tokens)
    for turn in replies:
        start, end = spans[turn]
        mask[start:end] = [1] * (end - start)
    return mask


def annealed(value: float, step: int, start: int, end: int) -> float:
    """`value` until `start`, then linearly down to 0 at `end` (steps of the stage)."""
    if step <= start:
        return value
    if step >= end:
        return 0.0
    return value * (end - step) / (end - start)


@dataclass
class SwarmStats:
    """What one swarm episode measured; kept on its trajectory as `swarm/...`."""

    subagents: int = 0
    assigned: int = 0
    refused: int = 0
    """Assignments the tool refused (past the subagent limit, an unknown or busy subagent)."""
    finished: int = 0
    peak: int = 0
    """The most subagents running at once."""
    peak_collected: int = 0
    """The most running at once whose answers the orchestrator then collected (`wait`)."""
    path: CriticalPath = field(default_factory=CriticalPath)
    wall_seconds: float = 0.0
    over_budget: bool = False
    """Ended by the critical-path budget before it answered."""

    def parts(self) -> dict[str, float]:
        return {"swarm/subagents": float(self.subagents), "swarm/assigned": float(self.assigned),
                "swarm/refused": float(self.refused),
                "swarm/finished": float(self.finished), "swarm/peak_parallel": float(self.peak),
                "swarm/peak_parallel_collected": float(self.peak_collected),
                "swarm/critical_path_steps": float(self.path.length),
                "swarm/total_steps": float(self.path.total),
                "swarm/wall_seconds": self.wall_seconds,
                "swarm/over_budget": float(self.over_budget)}
