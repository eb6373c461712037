"""A swarm evaluation's critical path over every episode and over those that answered: an
episode that ran out of turns unanswered has a short path, which must not read as a speed-up."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

from kiln.services.rollout.engine import SamplingOptions
from kiln.services.rollout.producer import Producer
from kiln.services.rollout.swarm_run import SwarmRun
from kiln.trajectory import Trajectory


def _traj(index: int) -> Trajectory:
    # Tasks 0 and 1 answered (right, then wrong) on a path of 17; 2 and 3 ran out of turns at 9.
    parts = ({"parl/perf": float(index == 0), "swarm/critical_path_steps": 17.0} if index < 2 else
             {"answered": 0.0, "parl/perf": 0.0, "swarm/critical_path_steps": 9.0})
    return Trajectory(id=str(index), task_id=str(index), group_id="", tokens=[1, 2], loss_mask=[0, 1],
                      logp_infer=[0.0, 0.0], version_spans=[], reward=parts["parl/perf"],
                      reward_parts=parts)


def test_the_answered_only_critical_path_leaves_unanswered_episodes_out() -> None:
    async def episode(stage, *, task_set, index, sampling, limits):
        return [_traj(index)]

    ext = SimpleNamespace(task_sets=frozenset({"heldout"}),
                          outcome=lambda t: SwarmRun.outcome(None, t))
    producer = SimpleNamespace(
        config=SimpleNamespace(max_concurrent=4, sampling=SamplingOptions(), limits=None),
        extensions={"swarm": ext}, engine=SimpleNamespace(policy_version=3), _episode=episode,
        samples=SimpleNamespace(keep_evaluation=lambda *args: None))
    n, greedy, sampled, path, answered, _ = asyncio.run(
        Producer.evaluate(producer, "heldout", 4, max_tasks=0, samples=0, greedy=True))
    assert (n, greedy, sampled) == (4, 0.25, 0.0)
    assert path == 13.0 and answered == 17.0
