"""Environment latency on demand: a task set's `toolLatency` (kiln.api.components.ToolLatency)
makes each tool call take extra wall-clock time, spent in the episode's own sandbox.

The time is a real `sleep` run where the tool ran, not an `asyncio.sleep` in this service, so
it occupies a sandbox slot and a process as a test run or a build would, and what the rollout
side sees (a step that returns seconds later) is what a slow environment gives it.
"""
from __future__ import annotations

import math
import random

from kiln.api.components import ToolLatency

#: z-score of the 99th percentile of a standard normal law.
Z99 = 2.326347874


def log_normal(p50: float, p99: float) -> tuple[float, float]:
    """(mu, sigma) of the log-normal law with this median and 99th percentile: ln X ~
    N(mu, sigma^2), mu = ln p50, sigma = (ln p99 - ln p50) / z99. `kiln simulate` draws its
    tools and episode lengths from the same law."""
    mu = math.log(p50)
    return mu, (math.log(p99) - mu) / Z99


class LatencyDraws:
    """Draws from the spec's log-normal law (`log_normal`), capped at maxSeconds."""

    def __init__(self, spec: ToolLatency) -> None:
        self.spec = spec
        self.mu, self.sigma = log_normal(spec.p50_seconds, spec.p99_seconds)
        self.rng = random.Random(spec.seed)

    def draw(self) -> float:
        return min(self.spec.max_seconds, math.exp(self.rng.gauss(self.mu, self.sigma)))


def sleep_command(seconds: float) -> str:
    return f"sleep {seconds:.3f}"
