"""Asynchronous rollout's scheduling, on a scripted engine and environment whose progress the
test controls (gates it opens, a clock it moves: no assertion depends on the machine's speed):
admission by engine occupancy, the engine's idle time, episodes stopped once their group is
beyond tau (on an engine whose version advances with each generation, so the boundary is exact),
and replicas that serve or drain versions. Tool latency: `test_tool_latency.py`."""
from __future__ import annotations

import asyncio
import time

import pytest

from kiln.episode import EpisodeInfo, Message, StepResult, ToolOutput
from kiln.services.common import metrics
from kiln.services.rollout.agent import Limits
from kiln.services.rollout.engine import Generation, SamplingOptions
from kiln.services.rollout.producer import EXPLORE, Mode, Producer, ProducerConfig



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


class GatedEngine(SlowEngine):
    """Generations that wait for `gate`: the test decides when the engine answers."""

    def __init__(self) -> None:
        super().__init__(0.0)
        self.gate = asyncio.Event()

    async def generate(self, prompt, sampling):
        self.generating += 1
        self.max_generating = max(self.max_generating, self.generating)
        try:
            await self.gate.wait()
        finally:
            self.generating -= 1
        return Generation([7, 8], [-0.5, -0.5], [self.policy_version] * 2, "stop")


class BlockedEnv(SlowEnv):
    """Tool calls that never return until the producer stops: every episode that has asked
    its environment something waits there."""

    def __init__(self) -> None:
        super().__init__(0.0, turns=3)
        self.stepping = 0

    async def step(self, episode_id, action):
        self.stepping += 1
        await asyncio.Event().wait()


async def until(condition, what: str, seconds: float = 60.0) -> None:
    """Wait for `condition` (a deadline generous for a loaded machine, not a measurement)."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"waited {seconds:g} s for {what}")
        await asyncio.sleep(0.01)


async def settle() -> None:
    """Let every task that can run do so (all of them live on this event loop)."""
    for _ in range(200):
        await asyncio.sleep(0)


def test_occupancy_admits_episodes_that_wait_on_their_environment():
    """With a target of 4, no more than 4 episodes occupy the engine while it works, however
    many the episode cap allows; an episode waiting on its environment frees its place, so far
    more than 4 are in flight; without the target the same cap floods the engine."""
    async def main(target, cap):
        engine, env = GatedEngine(), BlockedEnv()
        p, _ = producer(engine, env, max_concurrent=cap, target=target)
        p.start()
        p.set_mode(explore(group=2))
        try:
            await until(lambda: engine.generating >= min(target or cap, cap), "generations")
            await settle()
            admitted_while_busy = engine.generating
            engine.gate.set()  # the engine answers; each episode then waits on its tool call
            await until(lambda: env.stepping >= 16, "episodes waiting on their environment")
            return admitted_while_busy
        finally:
            await p.stop()

    busy = asyncio.run(main(4, 200))
    assert busy == 4, busy
    flooded = asyncio.run(main(None, 16))
    assert flooded == 16, flooded


def test_without_a_target_the_episode_cap_is_what_bounds_rollout():
    engine, env = SlowEngine(0.02), SlowEnv(0.2, turns=3)
    p, _ = producer(engine, env, max_concurrent=4)
    asyncio.run(run_for(p, explore(group=2), 1.0))
    assert env.max_open <= 4


class Clock:
    """The idle counter's clock, moved by the engine and environment below: the counter's sums
    are then exact, whatever the machine's load makes of real time (only `time.monotonic` in
    kiln.services.rollout.occupancy reads it; the event loop keeps the real one)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


class ClockedEngine(SlowEngine):
    """Each generation takes `seconds` of the clock, while it is in progress; `during` runs
    in the middle of each (the producer's periodic flush may land there)."""

    def __init__(self, clock: Clock, seconds: float) -> None:
        super().__init__(0.0)
        self.clock, self.step_seconds, self.generations = clock, seconds, 0
        self.during = lambda: None

    async def generate(self, prompt, sampling):
        self.generating += 1
        try:
            await asyncio.sleep(0)
            self.clock.now += self.step_seconds
            self.during()
            self.generations += 1
        finally:
            self.generating -= 1
        return Generation([7, 8], [-0.5, -0.5], [self.policy_version] * 2, "stop")


class ClockedEnv(SlowEnv):
    """Each tool call takes `seconds` of the clock, with no generation in progress."""

    def __init__(self, clock: Clock, seconds: float, turns: int) -> None:
        super().__init__(0.0, turns)
        self.clock, self.tool_seconds = clock, seconds

    async def step(self, episode_id, action):
        self.clock.now += self.tool_seconds
        return await super().step(episode_id, action)


def test_engine_idle_time_is_counted_while_episodes_wait(monkeypatch):
    """The idle counter adds up the time the engine had no generation in progress: one episode
    at a time, each generation 0.01 s and each tool call 0.3 s, so every second of the clock not
    spent generating is idle, and the engine is idle most of the time."""
    from types import SimpleNamespace

    from kiln.services.rollout import occupancy

    clock = Clock()
    monkeypatch.setattr(occupancy, "time", SimpleNamespace(monotonic=clock.monotonic))
    engine, env = ClockedEngine(clock, 0.01), ClockedEnv(clock, 0.3, turns=2)
    before = metrics.ROLLOUT_ENGINE_IDLE._value.get()
    start = clock.now
    p, buffer = producer(engine, env, max_concurrent=1)
    engine.during = p.engine.flush_idle  # a flush while generating adds nothing
    asyncio.run(run_until(p, explore(group=1), lambda: len(buffer.shipped) >= 3, timeout=60))
    p.engine.flush_idle()
    idle = metrics.ROLLOUT_ENGINE_IDLE._value.get() - before
    busy = engine.generations * 0.01
    assert len(buffer.shipped) >= 3 and engine.generations >= 6
    assert idle == pytest.approx(clock.now - start - busy, abs=1e-6), (idle, clock.now, busy)
    assert idle > 10 * busy


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


async def run_until(p: Producer, mode: Mode, done, timeout: float = 60.0) -> None:
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

    asyncio.run(asyncio.wait_for(main(), 120))
    assert p.stopped_stale == 0
    assert all(version - t.oldest_version <= 1 for version, t in buffer.shipped)


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

    asyncio.run(asyncio.wait_for(main(), 120))
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

    opened = asyncio.run(asyncio.wait_for(main(), 120))
    assert len(buffer.shipped) == opened  # the 8 in flight when it began were shipped too
    assert all(n == 3 for n in env.actions.values())  # every episode ran to its end
