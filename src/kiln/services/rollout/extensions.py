"""Episode extensions: features that play a stage's episodes their own way, beside the producer
rather than as branches inside it.

The producer (`producer.py`) plays an episode with `agent.run_episode` unless the stage it
belongs to has an `EpisodeExtension`; then the extension plays it, with what the producer lends
it (`EpisodeContext`), and it also plays the evaluation episodes of its `task_sets`. The producer
knows nothing else of it: a feature adds an extension (and its wiring in `main.py`), not a branch
in the producer. A feature whose reward is earned by some tokens rather than the whole episode
fills the trajectory's generic per-token channel (`Trajectory.shaping_reward`,
`Trajectory.shaping_mask`), which the trainer credits (`kiln.services.trainer.advantages`); it
adds no named field.

Extensions today: an agent swarm's stage (`swarm_run.SwarmRun`: an orchestrator's episode, the
swarm tools answered by rollout, PARL's reward).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple, Protocol

from kiln.services.rollout.engine import Engine
from kiln.services.rollout.formats import Format
from kiln.services.sandbox.client import EnvClient
from kiln.trajectory import Trajectory


@dataclass(frozen=True)
class EpisodeContext:
    """What the producer lends an extension for one episode."""

    engine: Engine
    """The engine of the policy being trained (timed by the producer)."""
    env: EnvClient
    """The job's environment, as the producer reaches it."""
    fmt: Format
    wrap: Callable[[EnvClient], EnvClient]
    """Wraps the environment the policy's episode steps, so that the producer counts the time
    it spends there as stepping, not occupying the engine (`occupancy.EnvTimer`)."""
    step: int
    """Policy versions since the stage began on this replica: where the stage's schedules are."""


class Outcome(NamedTuple):
    """What an evaluation reports of one episode."""

    reward: float
    """The task's own outcome (success when >= 1), whatever the training reward adds to it."""
    critical_path_steps: float = 0.0
    """The longest chain of dependent model calls, where the extension measures it; 0 if not."""
    answered: bool = True
    """Whether the episode gave an answer (right or wrong) rather than running out of turns or
    budget: the environment's and the agent loop's `answered` reward part, when they set one."""


class EpisodeExtension(Protocol):
    """Plays the episodes of one stage (see the module doc)."""

    task_sets: frozenset[str]
    """The stage's training and evaluation task sets: evaluations of these are played here too."""

    async def play(self, ctx: EpisodeContext, *, training: bool, **episode) -> list[Trajectory]:
        """One episode: `episode` holds `run_episode`'s keyword arguments (task_set, index,
        sampling, limits, and for training group_id and stale). `training`: an RL episode, not
        an evaluation's."""
        ...

    def outcome(self, trajectory: Trajectory) -> Outcome:
        """An evaluation episode's outcome, from the trajectory `play` returned."""
        ...

    async def close(self) -> None:
        """Release what the extension holds (engines, channels) when the rollout stops."""
        ...


def plain_outcome(trajectory: Trajectory) -> Outcome:
    """The outcome of an episode no extension played: its reward."""
    return Outcome(trajectory.reward, answered=answered(trajectory))


def answered(trajectory: Trajectory) -> bool:
    """An episode's `answered` reward part (the agent loop sets 0 for one out of turns, an
    environment 1 or 0 where it tells); true where nothing says otherwise."""
    return trajectory.reward_parts.get("answered", 1.0) > 0
