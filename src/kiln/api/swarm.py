"""An RL stage's agent swarm (`spec.stages[].swarm`): the frozen subagents an orchestrator
delegates to, their limits, and the PARL reward's weights (`kiln.swarm`). Torch-free."""
from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from kiln.api.components import Model
from kiln.swarm import annealed


class SwarmSettings(Model):
    """The stage trains an orchestrator; its subagents run a frozen checkpoint."""

    subagents: str = Field(min_length=1)
    """The subagents' weights: an earlier stage's name (its final checkpoint) or a checkpoint
    directory. Pinned for the whole stage: weight sync never reaches them."""
    max_subagents: int = Field(8, ge=1, le=64)
    """Subagents one episode may create; more is refused (the orchestrator is told)."""
    max_subagent_turns: int = Field(4, ge=1, le=64)
    """Model calls one subagent may make on its sub-task."""
    subagent_temperature: float | None = Field(None, ge=0)
    """The subagents' sampling temperature (0: greedy); unset: the rollout's
    (`spec.rollout.sampling.temperature`). Their tokens are never trained, so the orchestrator
    can explore at a high temperature while the frozen subagents keep finishing their
    sub-tasks. Evaluations sample the subagents at it too (a greedy evaluation is greedy for
    the orchestrator alone). On vLLM, at most 2, as the rollout's."""
    lambda_parallel: float = Field(0.5, ge=0)
    """lambda1: weight of r_parallel (subagents running side by side) before annealing."""
    lambda_finish: float = Field(0.5, ge=0)
    """lambda2: weight of r_finish (assigned sub-tasks really completed) before annealing."""
    parallel_reward: Literal["always", "outcome", "collected"] = "always"
    """How r_parallel is paid. `always`: as PARL states it, whatever the outcome. `outcome`:
    scaled by r_perf clipped to [0, 1], so that only an episode that solved its task earns it
    (r_finish is paid as before: it already asks that sub-tasks were completed, and it charges
    for assignments refused past the limit). It is for an orchestrator that can reach a wrong
    answer by a parallel route: with `always`, such an episode outscores a serial one cut off
    by the latency budget, and RL can reinforce the wrong answers. Measured in the docs
    (docs/results/swarm.md): it kept answers that `always` lost on one seed, and left another seed's
    greedy orchestrator serial. `collected`: the peak counts only subagents whose answers a
    `wait` later brought back, so an orchestrator that assigns everything and answers
    without waiting earns none of it (with `always` it earns it in full). Measured: it all but
    stopped that on the seed that learned it, and another seed's greedy orchestrator then
    assigned past the limit before its wait until its answer no longer fit the episode."""
    parallel_target: int | None = Field(None, ge=1)
    """r_parallel is min(peak, target) / target for the most subagents running at once;
    unset: maxSubagents."""
    max_critical_steps: int | None = Field(None, ge=2)
    """A latency budget for the stage's training episodes, in critical-path steps (the longest
    chain of dependent model calls, `kiln.swarm`): an episode whose next orchestrator call
    would pass it ends there with no answer (r_perf 0), as a deadline would end it. PARL's
    shaping terms anneal away; this is what keeps paying for parallelism after them, because
    a serial solver that would answer right answers too late. Evaluations run without it, so
    that held-out success and critical paths compare under the same conditions before and
    after training. Mind the shaping terms beside it: serial play cut off by the budget earns
    them alone, and parallel moves that never answer can outscore it (measured in the docs,
    docs/results/swarm.md). Unset: no budget."""
    end_on_refusal: bool = False
    """A training episode ends, unanswered (r_perf 0, flag `refused`), at the first assignment
    its limits refuse (past `maxSubagents`, an unknown or busy subagent); evaluations, and
    training with it off, get the refusal as an observation and go on. An assignment refused
    past the limit costs the critical path nothing while subagents run, and r_finish charges
    it only a fraction: a policy reinforced for assigning learned to assign past the limit
    until its answer no longer fit the episode (docs/results/swarm.md)."""
    max_critical_steps_start: int | None = Field(None, ge=2)
    """A looser budget for the stage's first step, tightening linearly (in whole steps) to
    `maxCriticalSteps` at `annealStart`, while the shaping terms are at full weight: a budget
    that one parallel move meets asks less of a policy that imitated serial play than one that
    only the fully parallel schedule meets. Unset: the budget is `maxCriticalSteps` from the
    start."""
    tool_choice_temperature_end: float | None = Field(None, gt=0, le=100)
    """The tool-choice temperature (`spec.rollout.sampling.toolChoiceTemperature`) of the
    stage's training episodes falls linearly from the rollout's at the stage's first step to
    this one at `annealStart`, while the budget tightens, and holds there. A hot tool choice
    finds parallel moves, but while it stays hot the episodes RL scores are nearly a coin toss
    at each choice, whatever the policy prefers: under a tight budget hardly one of them
    answers, and nothing tests what the policy's most likely choices do (what a greedy
    evaluation runs). Cooled, training plays the policy's own choices. Unset: the rollout's
    all stage long."""
    withdraw_at_limit: bool = False
    """At the subagent limit, `assign` (and `create_subagent`) leave the tools the orchestrator
    chooses among (`rollout.sampling.toolChoiceTemperature`, which it needs), in training and
    evaluation alike, until a subagent it can name is idle again; so its replies choose among
    the moves that can run, as they would among a game's legal moves. Off, an assignment past
    the limit is refused as an observation, and it costs nothing on the critical path while
    subagents run: in RL, the choice between it and `wait` hardly changed an episode's outcome,
    and the greedy orchestrator learned to assign past the limit until its answer no longer fit
    the episode (docs/results/swarm.md)."""
    shaping_credit: Literal["episode", "assignments"] = "episode"
    """Which tokens PARL's shaping terms (lambda1 r_parallel + lambda2 r_finish) are credited
    to. `episode`: the whole reward's group-relative advantage on every reply, as for any
    reward. `assignments`: the shaping terms' advantage goes to the replies whose assignment
    started a subagent, the rest of the reward's (r_perf's) to every reply; so the answer,
    the waits and any assignment refused past the limit answer to the outcome alone. With the
    episode's credit, a wrong answer or a refused assignment in an episode that ran its
    subagents side by side is reinforced with them. Measured on the docs' swarm example without
    `withdrawAtLimit`, it reinforced `assign` the more, and the greedy orchestrator assigned
    past the limit on three seeds of three (docs/results/swarm.md)."""
    anneal_start: int = Field(0, ge=0)
    """Step of the stage at which both lambdas start falling linearly..."""
    anneal_end: int | None = Field(None, ge=1)
    """...to reach 0 at this step (unset: the stage's maxSteps)."""

    @model_validator(mode="after")
    def _window(self):  # type: ignore[no-untyped-def]
        if self.anneal_end is not None and self.anneal_end <= self.anneal_start:
            raise ValueError(f"annealEnd ({self.anneal_end}) must come after annealStart "
                             f"({self.anneal_start})")
        if self.max_critical_steps_start is not None:
            if self.max_critical_steps is None or self.max_critical_steps_start < self.max_critical_steps:
                raise ValueError(f"maxCriticalStepsStart ({self.max_critical_steps_start}) needs a "
                                 f"maxCriticalSteps at most as large (got {self.max_critical_steps})")
            if self.anneal_start < 1:
                raise ValueError("maxCriticalStepsStart tightens the budget until annealStart, "
                                 "which is 0: set annealStart")
        if self.parallel_target is not None and self.parallel_target > self.max_subagents:
            raise ValueError(f"parallelTarget ({self.parallel_target}) exceeds maxSubagents "
                             f"({self.max_subagents}): r_parallel could never reach 1")
        return self

    @property
    def target(self) -> int:
        return self.parallel_target or self.max_subagents

    def tool_choice_temperature(self, step: int, base: float) -> float:
        """The tool-choice temperature of the stage's training episodes at `step`, `base`
        the rollout's."""
        low = self.tool_choice_temperature_end
        if low is None:
            return base
        if self.anneal_start < 1:
            return low
        return low + annealed(base - low, step, 0, self.anneal_start)

    def budget(self, step: int) -> int | None:
        """The critical-path budget of the stage's training episodes at `step`."""
        end, start = self.max_critical_steps, self.max_critical_steps_start
        if end is None or start is None or step >= self.anneal_start:
            return end
        return end + int((start - end) * (self.anneal_start - step) / self.anneal_start + 0.5)


def swarm_problems(spec) -> list[str]:
    """Why a job's swarms cannot run: subagents naming a stage that does not come earlier, or
    sampling hotter than their engine allows."""
    from kiln.api.sampling import VLLM_MAX_TEMPERATURE

    names = [s.name for s in spec.stages]
    problems = []
    for i, stage in enumerate(spec.stages):
        swarm = getattr(stage, "swarm", None)
        if swarm is None:
            continue
        hot = swarm.subagent_temperature
        if spec.rollout.engine == "vllm" and hot is not None and hot > VLLM_MAX_TEMPERATURE:
            problems.append(f"stages[{i}] ({stage.name}).swarm.subagentTemperature={hot:g}: vLLM "
                            f"samples at most at {VLLM_MAX_TEMPERATURE:g}")
        if swarm.tool_choice_temperature_end is not None:
            if spec.rollout.sampling.tool_choice_temperature is None:
                problems.append(f"stages[{i}] ({stage.name}).swarm.toolChoiceTemperatureEnd "
                                "anneals rollout.sampling.toolChoiceTemperature, which is unset")
        if swarm.withdraw_at_limit and spec.rollout.sampling.tool_choice_temperature is None:
            problems.append(f"stages[{i}] ({stage.name}).swarm.withdrawAtLimit withdraws tools "
                            "from the replies' tool choice; rollout.sampling.toolChoiceTemperature "
                            "is unset")
        if swarm.shaping_credit == "assignments" and spec.rollout.thinking == "turn-level":
            problems.append(f"stages[{i}] ({stage.name}).swarm.shapingCredit 'assignments' marks "
                            "replies in the episode's one context; rollout.thinking "
                            "'turn-level' splits it")
        ref = swarm.subagents
        if ref in names and names.index(ref) >= i:
            problems.append(f"stages[{i}] ({stage.name}).swarm.subagents: stage {ref!r} does not "
                            "come before this one, so it has no final checkpoint yet")
        elif ref not in names and "/" not in ref and not ref.startswith("."):
            problems.append(f"stages[{i}] ({stage.name}).swarm.subagents: {ref!r} is neither an "
                            f"earlier stage ({', '.join(names[:i]) or 'none'}) nor a checkpoint "
                            "directory (a path)")
    return problems
