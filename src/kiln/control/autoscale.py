"""Staleness-aware autoscaling of rollout: how many replicas an asynchronous RL stage should
have, from what the trainer and freshness control report after each optimizer step.

Two forces pull against each other. A trainer that waits for batches wants more rollout. More
rollout makes the trainer step sooner, so an episode spans more policy versions before it is
trained: staleness rises towards tau, and past tau freshness control throws the work away. The
rule therefore looks at both over the last `windowSteps` steps and gives freshness the last word:

1. a trained trajectory was `max(1, tau - stalenessMargin)` or more versions old, or
   `maxBufferBatches` batches wait in the buffer (rollout outruns the trainer): one fewer;
2. else the trainer waited at least `scaleUpIdle` of the window's time: one more;
3. else keep the count.

One step at a time, within [minReplicas, maxReplicas]; after a change the next decision waits
until a whole window of steps has been taken with the new count, so every decision sees the
effect of the last. `Autoscaler` is pure (it is fed numbers, it returns a number): the stage
driver feeds it and hands the decision to whatever owns the replicas (`kiln run`'s rollout
workers, the operator's `spec.rollout.replicas`).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from kiln.api.components import AutoscaleSpec


@dataclass(frozen=True)
class StepSignals:
    """What one optimizer step showed."""

    step: int
    wait_seconds: float
    """Time the trainer spent waiting for this step's batch."""
    step_seconds: float
    """Time of the step itself."""
    max_staleness: int
    """Oldest trajectory of the step's batch, in versions behind the trainer (-1: unknown)."""
    buffer_depth: int
    """Trajectories waiting in the buffer when the step was seen."""


@dataclass(frozen=True)
class Decision:
    replicas: int
    reason: str


class Autoscaler:
    def __init__(self, spec: AutoscaleSpec, *, tau: int | None, batch_size: int) -> None:
        self.spec, self.tau, self.batch_size = spec, tau, batch_size
        self.window: deque[StepSignals] = deque(maxlen=spec.window_steps)
        self._last_step = -1

    def observe(self, signals: StepSignals, replicas: int) -> Decision | None:
        """Feed one step (repeats of a step already seen are ignored); a Decision when the
        replica count should change."""
        if signals.step <= self._last_step:
            return None
        self._last_step = signals.step
        self.window.append(signals)
        if len(self.window) < self.window.maxlen:
            return None
        decision = self.decide(replicas)
        if decision is not None:
            self.hold()  # the next decision sees only steps taken with the new count
        return decision

    def hold(self) -> None:
        """Replicas are starting or leaving: forget the window, the next decision waits for a
        whole window of steps taken at a settled count."""
        self.window.clear()

    def decide(self, replicas: int) -> Decision | None:
        s, w = self.spec, list(self.window)
        worst = max(x.max_staleness for x in w)
        depth = w[-1].buffer_depth
        waited = sum(x.wait_seconds for x in w)
        busy = sum(x.step_seconds for x in w)
        idle = waited / (waited + busy) if waited + busy > 0 else 0.0
        # At least 1: a margin as large as tau must not make every fresh step a reason to shrink.
        if self.tau is not None and worst >= max(1, self.tau - s.staleness_margin):
            if replicas > s.min_replicas:
                return Decision(replicas - 1, f"staleness {worst} near tau {self.tau}")
            return None
        if depth >= s.max_buffer_batches * self.batch_size:
            if replicas > s.min_replicas:
                return Decision(replicas - 1, f"{depth} trajectories wait in the buffer "
                                              f"({depth / self.batch_size:.1f} batches)")
            return None
        if idle >= s.scale_up_idle and replicas < s.max_replicas:
            return Decision(replicas + 1, f"trainer idle {idle:.0%} of the last {len(w)} steps")
        return None
