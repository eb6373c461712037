"""Tool latency (`tasks[].toolLatency`): the draws follow the requested median and tail, the
latency is spent in the episode's sandbox (a real bubblewrap step), and the spec refuses a tail
below the median."""
from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from kiln.api.components import ToolLatency
from kiln.api.validate import load_job
from kiln.services.sandbox.latency import LatencyDraws

REPO = Path(__file__).resolve().parents[2]


def test_latency_draws_follow_the_requested_median_and_tail():
    draws = LatencyDraws(ToolLatency(p50_seconds=1.0, p99_seconds=30.0, max_seconds=1e9, seed=3))
    xs = sorted(draws.draw() for _ in range(20_000))
    assert xs[len(xs) // 2] == pytest.approx(1.0, rel=0.08)
    assert xs[int(len(xs) * 0.99)] == pytest.approx(30.0, rel=0.2)
    capped = LatencyDraws(ToolLatency(p50_seconds=1.0, p99_seconds=30.0, max_seconds=5.0))
    assert max(capped.draw() for _ in range(2000)) == 5.0


def test_tool_latency_is_spent_in_the_sandbox(monkeypatch):
    """A chain task set with 0.3 s per call: a real step (its tool run in bubblewrap) sleeps
    that long in the episode's sandbox, and so takes at least that long; a task set without
    it sleeps nowhere (what the sandbox was asked to run tells, not the machine's speed)."""
    from kiln.env import ToolCall
    from kiln.episode import Action
    from kiln.services.sandbox.bubblewrap import BubblewrapSandbox
    from kiln.services.sandbox.episodes import EpisodeManager

    job = load_job(REPO / "deploy" / "examples" / "quickstart.yaml")
    spec = job.spec.tasks[0].model_copy(update={
        "tool_latency": ToolLatency(p50_seconds=0.3, p99_seconds=0.3)})
    slow = job.model_copy(update={"spec": job.spec.model_copy(update={"tasks": [spec]})})
    ran: list[str] = []
    real_exec = BubblewrapSandbox.exec

    async def exec_and_record(self, cmd, **kwargs):
        ran.append(cmd if isinstance(cmd, str) else " ".join(cmd))
        return await real_exec(self, cmd, **kwargs)

    monkeypatch.setattr(BubblewrapSandbox, "exec", exec_and_record)

    async def one_step(manager) -> float:
        info = manager.open(spec.name, 0)
        action = Action(content="", tool_calls=[ToolCall("step", {"value": "3"})])
        t0 = time.perf_counter()
        try:
            await manager.step(info.episode_id, action)
        finally:
            await manager.close(info.episode_id)
        return time.perf_counter() - t0

    assert asyncio.run(one_step(EpisodeManager(slow, base_dir=REPO, owner="test-latency"))) >= 0.3
    assert ran and ran[-1] == "sleep 0.300", ran
    ran.clear()
    asyncio.run(one_step(EpisodeManager(job, base_dir=REPO, owner="test-latency")))
    assert ran and not [c for c in ran if c.startswith("sleep")], ran


def test_tool_latency_spec_refuses_a_tail_below_the_median():
    with pytest.raises(ValueError, match="p99Seconds"):
        ToolLatency(p50_seconds=2.0, p99_seconds=1.0)
