"""Asynchronous rollout's scheduling, on a scripted engine and environment whose timings the
test sets: admission by engine occupancy, the engine's idle time, episodes stopped once their
group is beyond tau (on an engine whose version advances with each generation, so the boundary is
exact), and the sandbox's added tool latency (which runs real sandboxes)."""
from __future__ import annotations

import asyncio
import statistics
import time
from pathlib import Path

import pytest

from kiln.api.components import ToolLatency
from kiln.api.validate import load_job
from kiln.episode import EpisodeInfo, Message, StepResult, ToolOutput
from kiln.services.common import metrics
from kiln.services.rollout.agent import Limits
from kiln.services.rollout.engine import Generation, SamplingOptions
from kiln.services.rollout.producer import EXPLORE, Mode, Producer, ProducerConfig
from kiln.services.sandbox.latency import LatencyDraws

REPO = Path(__file__).resolve().parents[2]


class SlowEngine:
    """Every generation takes `seconds` and returns two tokens at the current version."""

    fingerprint = "scripted"

    def __init__(self, seconds: float) -> None:
        self.seconds, self.policy_version = seconds, 0
        self.generating = self.max_generating = 0

    async def generate(self, prompt, sampling):
        self.generating += 1
        self.max_generating = max(self.max_generating, self.generating)
        try:
            await asyncio.sleep(self.seconds)
        finally:
            self.generating -= 1
        return Generation([7, 8], [-0.5, -0.5], [self.policy_version] * 2, "stop")


class SlowEnv:
    """Episodes of `turns` tool calls, each taking `seconds` in the environment."""

    def __init__(self, seconds: float, turns: int) -> None:
        self.seconds, self.turns = seconds, turns
        self.actions: dict[str, int] = {}
        self.open_now = self.max_open = 0

    async def open(self, task_set, index, max_actions):
        eid = f"e{len(self.actions)}"
        self.actions[eid] = 0
        self.open_now += 1
        self.max_open = max(self.max_open, self.open_now)
        return EpisodeInfo(eid, f"{task_set}-{index}", "scripted", [Message("user", "go")], [])

    async def step(self, episode_id, action):
        await asyncio.sleep(self.seconds)
        self.actions[episode_id] += 1
        if self.actions[episode_id] >= self.turns:
            return StepResult(done=True, reward=1.0)
        return StepResult([ToolOutput("", "t", "ok")])

    async def close(self, episode_id):
        self.open_now -= 1


class Conversation:
    restarted = False

    def prompt(self):
        return [1, 2, 3]

    def action_prefix(self):
        return []

    def read_reply(self, ids):
        return None

    def observation(self, outputs):
        return [4, 5]


class Format:
    stop_token_ids: list[int] = []

    def conversation(self, episode):
        return Conversation()


class Buffer:
    def __init__(self, engine) -> None:
        self.engine, self.shipped = engine, []

    async def put_async(self, trajectories, group_size=None, *, still_wanted=lambda: True):
        self.shipped += [(self.engine.policy_version, t) for t in trajectories]
        return object()


def producer(engine, env, *, max_concurrent, target=None) -> tuple[Producer, Buffer]:
    buffer = Buffer(engine)
    p = Producer(ProducerConfig(
        sampling=SamplingOptions(max_tokens=4),
        limits=Limits(max_turns=20, max_tokens_per_turn=4, max_total_tokens=10_000),
        max_concurrent=max_concurrent, target_occupancy=target), engine, env, Format(), buffer)
    return p, buffer


def explore(group: int = 2, tau: int | None = None, synchronous: bool = False,
            batch: int = 0) -> Mode:
    return Mode(EXPLORE, "rl", [("t", 100)], group, synchronous, batch, 0, tau)


async def run_for(p: Producer, mode: Mode, seconds: float, during=None) -> None:
    p.start()
    p.set_mode(mode)
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        if during is not None:
            during()
        await asyncio.sleep(0.05)
    await p.stop()


def test_occupancy_admits_episodes_that_wait_on_their_environment():
    """With tools 10x slower than the model, a target of 4 keeps far more than 4 episodes in
    flight while the engine works on a few at a time (episodes that come back from their tools
    together can exceed it for a moment: admission is what the target bounds); without the
    target the same episode cap floods the engine."""
    def run(target):
        engine, env = SlowEngine(0.02), SlowEnv(0.2, turns=3)
        p, buffer = producer(engine, env, max_concurrent=200, target=target)
        samples: list[int] = []
        asyncio.run(run_for(p, explore(group=2), 2.0,
                            during=lambda: samples.append(engine.generating)))
        assert buffer.shipped
        return statistics.mean(samples[len(samples) // 4:]), env.max_open

    busy, in_flight = run(4)
    assert 1 <= busy <= 2 * 4 and in_flight >= 12, (busy, in_flight)
    flooded, _ = run(None)
    assert flooded > 2 * busy, (flooded, busy)


def test_without_a_target_the_episode_cap_is_what_bounds_rollout():
    engine, env = SlowEngine(0.02), SlowEnv(0.2, turns=3)
    p, _ = producer(engine, env, max_concurrent=4)
    asyncio.run(run_for(p, explore(group=2), 1.0))
    assert env.max_open <= 4


class TimedEngine(SlowEngine):
    """Keeps how long it had a generation in progress, as measured from inside."""

    def __init__(self, seconds: float) -> None:
        super().__init__(seconds)
        self.busy, self._since = 0.0, 0.0

    async def generate(self, prompt, sampling):
        if self.generating == 0:
            self._since = time.monotonic()
        try:
            return await super().generate(prompt, sampling)
        finally:
            if self.generating == 0:
                self.busy += time.monotonic() - self._since


def test_engine_idle_time_is_counted_while_episodes_wait():
    """The idle counter adds up the time the engine had no generation in progress, whatever
    the machine's load makes of the run's timings. Two episodes that generate 10 ms and then
    wait 300 ms: the engine is idle most of the time."""
    engine, env = TimedEngine(0.01), SlowEnv(0.3, turns=2)
    before = metrics.ROLLOUT_ENGINE_IDLE._value.get()
    t0 = time.monotonic()
    p, _ = producer(engine, env, max_concurrent=2)
    asyncio.run(run_for(p, explore(group=2), 1.5))
    p.engine.flush_idle()
    wall = time.monotonic() - t0
    idle = metrics.ROLLOUT_ENGINE_IDLE._value.get() - before
    assert engine.busy > 0
    assert idle == pytest.approx(wall - engine.busy, abs=0.05), (idle, wall, engine.busy)
    assert idle > wall / 2, (idle, wall)


class PublishingEngine(SlowEngine):
    """A trainer that publishes after every generation: each generation samples one version
    later than the one before, so an episode's k-th generation is k versions newer than its
    first, whatever the machine's speed."""

    def __init__(self) -> None:
        super().__init__(0.0)

    async def generate(self, prompt, sampling):
        gen = await super().generate(prompt, sampling)
        self.policy_version += 1
        return gen


class ClosingEnv(SlowEnv):
    """Keeps how many steps each episode had taken when it was closed, in order."""

    def __init__(self, turns: int) -> None:
        super().__init__(0.0, turns)
        self.closed: list[int] = []

    async def close(self, episode_id):
        self.closed.append(self.actions[episode_id])
        await super().close(episode_id)


async def run_until(p: Producer, mode: Mode, done, timeout: float = 10.0) -> None:
    p.start()
    p.set_mode(mode)
    deadline = time.monotonic() + timeout
    try:
        while not done() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
    finally:
        await p.stop()


@pytest.mark.parametrize("tau", [0, 1, 3])
def test_an_episode_stops_once_its_group_is_more_than_tau_behind(tau: int):
    """An episode whose first tokens are exactly tau versions old still generates; once they
    are tau + 1 old it stops, before that generation: tau + 1 generations in all."""
    engine, env = PublishingEngine(), ClosingEnv(turns=50)
    p, buffer = producer(engine, env, max_concurrent=1)
    asyncio.run(run_until(p, explore(group=1, tau=tau), lambda: p.stopped_stale >= 2))
    assert p.stopped_stale >= 2 and not buffer.shipped
    assert env.closed[:2] == [tau + 1, tau + 1]


@pytest.mark.parametrize("tau", [0, 1, 3])
def test_an_episode_exactly_tau_old_at_its_last_generation_is_shipped(tau: int):
    """Episodes of tau + 1 turns end just in time: shipped, with tokens spanning exactly tau
    versions, and none stopped."""
    engine, env = PublishingEngine(), ClosingEnv(turns=tau + 1)
    p, buffer = producer(engine, env, max_concurrent=1)
    asyncio.run(run_until(p, explore(group=1, tau=tau), lambda: len(buffer.shipped) >= 2))
    assert len(buffer.shipped) >= 2 and p.stopped_stale == 0
    for _, t in buffer.shipped:
        assert t.newest_version - t.oldest_version == tau


def test_synchronous_batches_are_never_stopped_for_staleness():
    engine, env = SlowEngine(0.01), SlowEnv(0.02, turns=3)
    p, buffer = producer(engine, env, max_concurrent=8)

    async def main():
        p.start()
        p.set_mode(explore(group=2, tau=0, synchronous=True, batch=4))
        for _ in range(3):
            while len(buffer.shipped) < 4 * (engine.policy_version + 1):
                await asyncio.sleep(0.02)
            engine.policy_version += 1
        await p.stop()

    asyncio.run(asyncio.wait_for(main(), 30))
    assert p.stopped_stale == 0
    assert all(version - t.oldest_version <= 1 for version, t in buffer.shipped)


def test_latency_draws_follow_the_requested_median_and_tail():
    draws = LatencyDraws(ToolLatency(p50_seconds=1.0, p99_seconds=30.0, max_seconds=1e9, seed=3))
    xs = sorted(draws.draw() for _ in range(20_000))
    assert xs[len(xs) // 2] == pytest.approx(1.0, rel=0.08)
    assert xs[int(len(xs) * 0.99)] == pytest.approx(30.0, rel=0.2)
    capped = LatencyDraws(ToolLatency(p50_seconds=1.0, p99_seconds=30.0, max_seconds=5.0))
    assert max(capped.draw() for _ in range(2000)) == 5.0


def test_tool_latency_is_spent_in_the_sandbox():
    """A chain task set with 0.3 s per call: a real step (its tool run in bubblewrap) takes at
    least that long, and a task set without it does not."""
    from kiln.env import ToolCall
    from kiln.episode import Action
    from kiln.services.sandbox.episodes import EpisodeManager

    job = load_job(REPO / "deploy" / "examples" / "quickstart.yaml")
    spec = job.spec.tasks[0].model_copy(update={
        "tool_latency": ToolLatency(p50_seconds=0.3, p99_seconds=0.3)})
    slow = job.model_copy(update={"spec": job.spec.model_copy(update={"tasks": [spec]})})

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
    assert asyncio.run(one_step(EpisodeManager(job, base_dir=REPO, owner="test-latency"))) < 0.3


def test_tool_latency_spec_refuses_a_tail_below_the_median():
    with pytest.raises(ValueError, match="p99Seconds"):
        ToolLatency(p50_seconds=2.0, p99_seconds=1.0)


def test_a_replica_starts_no_episode_before_it_serves_the_ordered_version():
    """A replica that just joined gets the order with the trainer's version: it waits for its
    engine to have those weights before its first episode."""
    engine, env = SlowEngine(0.01), SlowEnv(0.01, turns=1)
    p, buffer = producer(engine, env, max_concurrent=8)
    mode = explore(group=2)
    mode.min_version = 3

    async def main():
        p.start()
        p.set_mode(mode)
        await asyncio.sleep(0.5)
        assert not env.actions  # nothing opened on version 0
        engine.policy_version = 3
        while not buffer.shipped:
            await asyncio.sleep(0.02)
        await p.stop()

    asyncio.run(asyncio.wait_for(main(), 30))
    assert all(t.oldest_version >= 3 for _, t in buffer.shipped)


def test_a_drained_replica_ships_its_episodes_in_flight_and_starts_no_more():
    engine, env = SlowEngine(0.01), SlowEnv(0.1, turns=3)
    p, buffer = producer(engine, env, max_concurrent=8)

    async def main():
        p.start()
        p.set_mode(explore(group=2))
        while p.in_flight < 8:
            await asyncio.sleep(0.01)
        opened = len(env.actions)
        await p.drain(10)
        assert p.in_flight == 0 and len(env.actions) == opened  # none new after the drain began
        await p.stop()
        return opened

    opened = asyncio.run(asyncio.wait_for(main(), 30))
    assert len(buffer.shipped) == opened  # the 8 in flight when it began were shipped too
    assert all(n == 3 for n in env.actions.values())  # every episode ran to its end
