"""What `kiln simulate`'s simulator (`simulator.py`) takes and gives: the workload (episode
lengths, tokens, tool latency), one engine replica's speed, the job's RL settings, and the
result of one run, plus the episode-length laws it draws from."""
from __future__ import annotations

import itertools
import math
import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

from kiln.services.sandbox.latency import log_normal


@dataclass
class Workload:
    """What one episode looks like."""

    calls: Callable[[random.Random], int]
    """Tool calls of one episode (it has calls + 1 generations)."""
    gen_tokens: int = 22
    """Tokens sampled per generation."""
    prompt_tokens: int = 24
    obs_tokens: int = 10
    """Context tokens each tool's output adds."""
    tool_p50: float = 0.0
    tool_p99: float = 0.0
    tool_max: float = math.inf

    def __post_init__(self) -> None:
        self._tool_law = log_normal(self.tool_p50, self.tool_p99) if self.tool_p50 > 0 else None

    def tool_latency(self, rng: random.Random) -> float:
        """The sandbox's `toolLatency` law (0 without one)."""
        if self._tool_law is None:
            return 0.0
        return min(self.tool_max, math.exp(rng.gauss(*self._tool_law)))


@dataclass
class EngineModel:
    """One replica's speed."""

    step_base: float
    """Seconds of one decode step with no sequence (weights read, launch overhead)."""
    step_per_seq: float
    """Seconds each decoding sequence adds to a step."""
    prefill_cost: float = 0.05
    """Decode steps' worth of work per prefilled context token."""
    max_seqs: int = 256
    """Sequences decoding at once (vLLM's max_num_seqs); the others wait."""


@dataclass
class JobModel:
    batch: int
    group: int
    tau: int | None
    asynchronous: bool
    train_step: float
    """Seconds of one optimizer step."""
    sync_pause: float = 0.5
    """Seconds a replica stops generating to load a new version."""
    replicas: int = 1
    max_concurrent: int = 64
    """Episodes in flight per replica, at most."""
    target_occupancy: int | None = None
    sync_interval: int = 1
    steps: int = 10


@dataclass
class Result:
    seconds: float
    steps: int
    trained: int
    trainer_idle: float
    engine_idle: float
    """Mean over replicas of the fraction of time with nothing to decode."""
    staleness: Counter = field(default_factory=Counter)
    stopped_stale: int = 0
    dropped_stale: int = 0
    episodes: int = 0
    episode_seconds: list[float] = field(default_factory=list)
    """Wall time of each finished episode, admission to its last generation."""
    step_times: list[float] = field(default_factory=list)
    """When each optimizer step ended."""

    @property
    def trajectories_per_minute(self) -> float:
        return self.trained / self.seconds * 60 if self.seconds else 0.0

    def steady_per_minute(self, batch: int) -> float:
        """Trajectories trained per minute from the end of the first quarter of the steps on:
        without the start, where rollout fills up and nothing is trained yet (which long
        episodes make a large share of a short run)."""
        k = max(1, len(self.step_times) // 4)
        if len(self.step_times) <= k:
            return self.trajectories_per_minute
        span = self.step_times[-1] - self.step_times[k - 1]
        return (len(self.step_times) - k) * batch / span * 60 if span > 0 else 0.0

    @property
    def max_staleness(self) -> int:
        return max(self.staleness, default=0)


def zipf_calls(num_steps: int, tail: float) -> Callable[[random.Random], int]:
    """The chain task's long-tailed call counts (ZipfRepeats): k in [1, 4 * numSteps] with
    P(k) proportional to k^-tail."""
    k_max = 4 * num_steps
    weights = [k ** -tail for k in range(1, k_max + 1)]
    total = sum(weights)
    cdf = list(itertools.accumulate(w / total for w in weights))

    def draw(rng: random.Random) -> int:
        u = rng.random()
        return next((k for k, c in enumerate(cdf, 1) if u <= c), k_max)
    return draw


def nominal_episode_seconds(workload: Workload, engine: EngineModel, occupancy: int,
                            samples: int = 20_000, seed: int = 0) -> tuple[float, float]:
    """(p50, p99) of an episode's length as the workload defines it: its generations at the
    speed of an engine decoding `occupancy` sequences, plus its tools, with no waiting for a
    slot and no stop for staleness (the finished episodes of a run are shorter: freshness
    control cuts the tail)."""
    rng = random.Random(seed)
    per_token = engine.step_base + engine.step_per_seq * occupancy
    xs = sorted((k + 1) * workload.gen_tokens * per_token
                + sum(workload.tool_latency(rng) for _ in range(k))
                for k in (workload.calls(rng) for _ in range(samples)))
    return xs[samples // 2], xs[int(samples * 0.99)]
