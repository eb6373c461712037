"""How busy the inference engine is, and the time it had nothing to do.

Agentic episodes spend much of their life outside the model (a tool runs tests, a build, a web
request). A fixed number of episodes in flight then leaves the engine idle whenever most of
them wait on their environment; admitting episodes by the engine's occupancy instead (rollout's
`targetEngineOccupancy`) keeps it fed however long the tools take. An episode occupies the
engine from its admission to its end except while a step of its environment is in progress, so
a newly admitted group counts at once, before its first prefill has even reached the engine,
and a finished member stops counting while its group waits for the others.

`EngineTimer` wraps the engine the agent loop calls and accumulates the engine's idle time
(from each transition to and from zero generate calls in progress) into
`kiln_rollout_engine_idle_seconds_total`; `EnvTimer` wraps the environment and counts the steps
in progress.
"""
from __future__ import annotations

import asyncio
import time
from typing import Sequence

from kiln.episode import Action, StepResult
from kiln.services.common import metrics
from kiln.services.rollout.engine import Engine, Generation, SamplingOptions
from kiln.services.sandbox.client import EnvClient


class Occupancy:
    """Episodes admitted and not finished, and how many of them wait on their environment."""

    def __init__(self) -> None:
        self.admitted = 0
        self.stepping = 0
        self._changed = asyncio.Event()

    @property
    def engine_side(self) -> int:
        """Episodes generating, or about to: admitted and not in an environment step."""
        return self.admitted - self.stepping

    def admit(self, n: int) -> None:
        self.admitted += n

    def finish(self, n: int) -> None:
        self.admitted -= n
        self._changed.set()

    def changed(self) -> None:
        self._changed.set()

    async def below(self, target: int) -> None:
        """Return once fewer than `target` episodes occupy the engine."""
        while self.engine_side >= target:
            self._changed.clear()
            await self._changed.wait()


class EngineTimer:
    """An `Engine` that forwards to another, counting its generate calls in progress and the
    time it had none."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.generating = 0
        self._idle_since: float | None = time.monotonic()

    @property
    def policy_version(self) -> int:
        return self.engine.policy_version

    @property
    def fingerprint(self) -> str:
        return self.engine.fingerprint

    async def generate(self, prompt_token_ids: Sequence[int], sampling: SamplingOptions) -> Generation:
        if self.generating == 0:
            self.flush_idle()
            self._idle_since = None
        self.generating += 1
        metrics.ROLLOUT_ENGINE_REQUESTS.set(self.generating)
        try:
            return await self.engine.generate(prompt_token_ids, sampling)
        finally:
            self.generating -= 1
            metrics.ROLLOUT_ENGINE_REQUESTS.set(self.generating)
            if self.generating == 0:
                self._idle_since = time.monotonic()

    def __getattr__(self, name: str):
        return getattr(self.engine, name)  # score, apply_weights, close, ...

    def flush_idle(self) -> None:
        """Add the idle time since the last flush to the counter (periodically, so that the
        counter also advances during a long idle stretch, and whenever the engine gets work)."""
        if self._idle_since is not None:
            now = time.monotonic()
            metrics.ROLLOUT_ENGINE_IDLE.inc(now - self._idle_since)
            self._idle_since = now


class EnvTimer:
    """An `EnvClient` that forwards to another and tells `Occupancy` about its steps."""

    def __init__(self, env: EnvClient, occupancy: Occupancy) -> None:
        self.env, self.occupancy = env, occupancy

    async def step(self, episode_id: str, action: Action) -> StepResult:
        self.occupancy.stepping += 1
        self.occupancy.changed()  # this episode has left the engine
        try:
            return await self.env.step(episode_id, action)
        finally:
            self.occupancy.stepping -= 1

    def __getattr__(self, name: str):
        return getattr(self.env, name)  # open, close, demonstrate, ...
