"""A swarm stage as rollout runs it: the producer's episode extension (`extensions.py`) for the
stages that train an orchestrator.

`SwarmRun` holds the stage's subagents (on their frozen engine) and its settings, and plays each
episode of the stage as an orchestrator's (`swarm.run_swarm_episode`) with PARL's weights and the
episode's limits where the stage's schedules put them at its current step: the lambdas annealed
(`kiln.swarm.annealed`), the tool choice cooled and the critical-path budget (`SwarmSettings`).
Training episodes are held to the budget and, if the stage says so, end at a refused assignment;
evaluation episodes sample as the rollout does, without budget. The shaping terms credited by
turn (`shapingCredit: assignments`) travel on the trajectory's generic channel
(`shaping_reward`, `shaping_mask`). An evaluation's outcome is the task's own reward (`parl/perf`,
not PARL's total) and the episode's critical path.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kiln.api.swarm import SwarmSettings
from kiln.services.common import metrics
from kiln.services.rollout.engine import SamplingOptions
from kiln.services.rollout.extensions import EpisodeContext, Outcome, answered
from kiln.services.rollout.swarm import Subagents, run_swarm_episode
from kiln.swarm import Parl, annealed
from kiln.trajectory import Trajectory


@dataclass
class SwarmRun:
    """A swarm stage as rollout runs it: its subagents, PARL's weights and their schedule."""

    settings: SwarmSettings
    subagents: Subagents
    max_steps: int
    task_sets: frozenset[str] = frozenset()
    """The stage's training and evaluation task sets (played by orchestrators)."""

    async def play(self, ctx: EpisodeContext, *, training: bool, **episode) -> list[Trajectory]:
        """One orchestrator's episode at the stage's step (`EpisodeExtension.play`)."""
        episode.update(self.options(ctx.step, training, episode["sampling"]))
        trajs = await run_swarm_episode(ctx.engine, ctx.env, ctx.fmt, self.subagents,
                                        self.parl(ctx.step), wrap=ctx.wrap, **episode)
        self.observe(trajs)
        return trajs

    def outcome(self, trajectory: Trajectory) -> Outcome:
        """Success is the task's own outcome, not PARL's shaped total (evaluation asks no reward
        model either); the critical path as the episode measured it."""
        parts = trajectory.reward_parts
        return Outcome(parts.get("parl/perf", trajectory.reward),
                       parts.get("swarm/critical_path_steps", 0.0), answered(trajectory))

    async def close(self) -> None:
        await self.subagents.engine.close()

    def parl(self, step: int) -> Parl:
        s = self.settings
        end = s.anneal_end or self.max_steps
        return Parl(annealed(s.lambda_parallel, step, s.anneal_start, end),
                    annealed(s.lambda_finish, step, s.anneal_start, end), s.target,
                    paid=s.parallel_reward)

    def options(self, step: int, training: bool, sampling: SamplingOptions) -> dict:
        """`run_swarm_episode`'s settings for an episode at `step` sampled with `sampling`: a
        training one's (the tool choice cooled on schedule), or an evaluation's (the rollout's
        sampling, no latency budget, refusals observed)."""
        s = self.settings
        if training and sampling.tool_choice_temperature is not None:
            sampling = dataclasses.replace(sampling, tool_choice_temperature=s.tool_choice_temperature(
                step, sampling.tool_choice_temperature))
        return {"sampling": sampling, "budget": s.budget(step) if training else None,
                "end_on_refusal": training and s.end_on_refusal, "credit": s.shaping_credit,
                "withdraw": s.withdraw_at_limit}

    def observe(self, trajs: list[Trajectory]) -> None:
        """The episode's measurements into Prometheus."""
        if not trajs:
            return
        parts = trajs[-1].reward_parts
        metrics.SWARM_SUBAGENTS.observe(parts.get("swarm/subagents", 0.0))
        metrics.SWARM_CRITICAL_PATH.observe(parts.get("swarm/critical_path_steps", 0.0))
        metrics.SWARM_TOTAL_STEPS.observe(parts.get("swarm/total_steps", 0.0))
