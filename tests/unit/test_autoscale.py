"""Staleness-aware autoscaling: the rule on hand-made steps, and the stage driver resizing
rollout through a scaler while a scripted trainer starves and then trains stale data."""
from __future__ import annotations

from pathlib import Path

import pytest

from kiln.api.components import AutoscaleSpec
from kiln.api.spec import RLJob
from kiln.control.autoscale import Autoscaler, StepSignals
from kiln.control import Evaluation, ModeRequest, RolloutStatus, TrainerStatus
from kiln.control.driver import (ControlPlane, Driver, DriverHooks, DriverOptions, FileStore,
                                 RunState)
from kiln.metrics import StepMetrics

SPEC = AutoscaleSpec(min_replicas=1, max_replicas=4, scale_up_idle=0.3, staleness_margin=1,
                     max_buffer_batches=2, window_steps=2)


def steps(scaler: Autoscaler, replicas: int, *rows) -> list:
    out = []
    for i, (waited, stepped, stale, depth) in enumerate(rows, start=1):
        d = scaler.observe(StepSignals(i, waited, stepped, stale, depth), replicas)
        out.append(d)
        if d is not None:
            replicas = d.replicas
    return out


def test_a_starving_trainer_gets_another_replica_one_window_at_a_time():
    a = Autoscaler(SPEC, tau=4, batch_size=64)
    decisions = steps(a, 1, (3.0, 1.0, 0, 0), (3.0, 1.0, 1, 0), (3.0, 1.0, 1, 0), (3.0, 1.0, 1, 0))
    assert [d and d.replicas for d in decisions] == [None, 2, None, 3]
    assert "trainer idle 75%" in decisions[1].reason


def test_staleness_near_tau_wins_over_a_starving_trainer():
    a = Autoscaler(SPEC, tau=4, batch_size=64)
    decisions = steps(a, 3, (3.0, 1.0, 0, 0), (3.0, 1.0, 3, 0))
    assert decisions[-1].replicas == 2 and "staleness 3 near tau 4" in decisions[-1].reason


def test_a_backed_up_buffer_scales_down_and_the_bounds_hold():
    a = Autoscaler(SPEC, tau=4, batch_size=64)
    assert steps(a, 2, (0.0, 1.0, 0, 10), (0.0, 1.0, 0, 128))[-1].replicas == 1
    assert steps(Autoscaler(SPEC, tau=4, batch_size=64), 1,
                 (0.0, 1.0, 0, 200), (0.0, 1.0, 3, 200)) == [None, None]  # at minReplicas
    assert steps(Autoscaler(SPEC, tau=4, batch_size=64), 4,
                 (5.0, 1.0, 0, 0), (5.0, 1.0, 0, 0)) == [None, None]  # at maxReplicas


def test_a_busy_fresh_trainer_keeps_the_count_and_repeated_steps_are_ignored():
    a = Autoscaler(SPEC, tau=4, batch_size=64)
    assert steps(a, 2, (0.1, 1.0, 1, 10), (0.1, 1.0, 2, 10), (0.1, 1.0, 1, 10)) == [None] * 3
    assert a.observe(StepSignals(0, 9.0, 1.0, 0, 0), 2) is None  # an old step


def test_autoscale_bounds_are_checked_in_the_spec():
    with pytest.raises(ValueError, match="maxReplicas"):
        AutoscaleSpec(min_replicas=3, max_replicas=2)
    with pytest.raises(ValueError, match="within autoscale"):
        RLJob.model_validate(_job(replicas=5))


# --------------------------------------------------------------------------- through the driver


def _job(replicas: int = 1) -> dict:
    return {
        "apiVersion": "kiln.dev/v1alpha1", "kind": "RLJob", "metadata": {"name": "a"},
        "spec": {"model": {"path": "m"},
                 "tasks": [{"name": "t", "env": "chain", "generate": {"count": 4}}],
                 "rollout": {"replicas": replicas, "autoscale": {
                     "minReplicas": 1, "maxReplicas": 3, "windowSteps": 2}},
                 "stages": [{"name": "rl", "type": "rl", "tasks": ["t"], "maxSteps": 16,
                             "batchSize": 8, "microBatchSize": 8,
                             "rl": {"groupSize": 8, "tau": 3}}]}}


class ScriptedTrainer:
    """One step per poll. Its batches come slowly while rollout has fewer than 3 replicas, and
    turn stale (2 versions, tau - margin) once it has 3."""

    def __init__(self, scaler: "Workers") -> None:
        self.scaler, self.step, self.stage = scaler, 0, ""

    def start_stage(self, name: str) -> TrainerStatus:
        self.stage = name
        return self.status()

    def status(self) -> TrainerStatus:
        if not self.stage:
            return TrainerStatus()
        self.step = min(16, self.step + 1)
        n = self.scaler.replicas()
        waited = 2.0 if n < 3 else 0.0
        stale = 2 if n >= 3 else 0
        return TrainerStatus(step=self.step, policy_version=self.step, stage=self.stage,
                             stage_step=self.step, stage_max_steps=16, stage_done=self.step >= 16,
                             last_step=StepMetrics(wait_seconds=waited, step_seconds=1.0,
                                                   staleness={stale: 8}))


class Workers:
    def __init__(self) -> None:
        self.n, self.history = 1, [1]

    def replicas(self) -> int:
        return self.n

    def settled(self) -> bool:
        return True

    def scale(self, replicas: int) -> None:
        self.n = replicas
        self.history.append(replicas)


class Rollout:
    def __init__(self, trainer) -> None:
        self.trainer, self.mode, self.orders = trainer, ModeRequest(), []

    def set_mode(self, mode: ModeRequest) -> RolloutStatus:
        self.mode = mode
        self.orders.append(mode)
        return self.status()

    def evaluate(self, task_set, *, samples, greedy) -> Evaluation:
        raise AssertionError("no evaluation in this job")

    def status(self) -> RolloutStatus:
        return RolloutStatus(self.mode.mode, self.mode.stage, policy_version=self.trainer.step)


class Buffer:
    def status(self):
        from helpers.fakes import FakeBufferStatus
        return FakeBufferStatus()


def test_the_driver_scales_rollout_up_while_the_trainer_starves_and_down_near_tau(tmp_path: Path):
    workers = Workers()
    trainer = ScriptedTrainer(workers)
    rollout = Rollout(trainer)
    events = []
    Driver(RLJob.model_validate(_job()), ControlPlane(trainer, rollout, Buffer(), workers),
           RunState.load(FileStore(tmp_path / "state.json")),
           DriverHooks(say=lambda s: None, on_event=events.append), DriverOptions(poll_seconds=0.0)).run()
    # Up to 3 while the trainer waits, back to 2 when staleness reaches tau - 1, and so on:
    # it settles between the two forces rather than running away.
    assert workers.history[:3] == [1, 2, 3] and workers.history[3] == 2
    assert max(workers.history) == 3
    scales = [e for e in events if e["event"] == "scale"]
    assert [e["to"] for e in scales] == workers.history[1:]
    assert "staleness 2 near tau 3" in scales[2]["reason"]


def test_a_synchronous_stage_is_never_autoscaled(tmp_path: Path):
    data = _job()
    data["spec"]["stages"][0]["rl"]["async"] = False
    workers = Workers()
    trainer = ScriptedTrainer(workers)
    Driver(RLJob.model_validate(data), ControlPlane(trainer, Rollout(trainer), Buffer(), workers),
           RunState.load(FileStore(tmp_path / "state.json")),
           DriverHooks(say=lambda s: None), DriverOptions(poll_seconds=0.0)).run()
    assert workers.history == [1]


def test_a_margin_as_large_as_tau_still_lets_fresh_steps_scale_up():
    a = Autoscaler(SPEC.model_copy(update={"staleness_margin": 2}), tau=1, batch_size=64)
    assert steps(a, 1, (3.0, 1.0, 0, 0), (3.0, 1.0, 0, 0))[-1].replicas == 2
    b = Autoscaler(SPEC.model_copy(update={"staleness_margin": 2}), tau=1, batch_size=64)
    assert steps(b, 2, (3.0, 1.0, 0, 0), (3.0, 1.0, 1, 0))[-1].replicas == 1
