"""The stage driver against in-process services: stages in order, evaluations kept, orders
repeated to a service that restarted, transient errors waited out, a stop request honoured."""
from __future__ import annotations

from pathlib import Path

import pytest

from kiln.api.spec import RLJob
from kiln.control import Evaluation, ModeRequest, RolloutMode, RolloutStatus, TrainerStatus
from kiln.control.driver import (ControlPlane, Driver, DriverHooks, DriverOptions, FileStore,
                                 RunState, Stopped)

from helpers.fakes import FakeBufferStatus

JOB = RLJob.model_validate({
    "apiVersion": "kiln.dev/v1alpha1", "kind": "RLJob", "metadata": {"name": "d"},
    "spec": {"model": {"path": "m"},
             "tasks": [{"name": "t", "env": "chain", "generate": {"count": 4}},
                       {"name": "h", "env": "chain", "generate": {"count": 4, "split": "heldout"}}],
             "stages": [{"name": "sft", "type": "sft", "tasks": ["t"], "maxSteps": 5, "batchSize": 2,
                         "microBatchSize": 2},
                        {"name": "rl", "type": "rl", "tasks": ["t"], "maxSteps": 2, "batchSize": 8,
                         "microBatchSize": 8, "rl": {"groupSize": 8}, "eval": {"tasks": ["h"]}}]}})


class Down(Exception):
    pass


class FakeTrainer:
    """Takes one step per status poll; `restart()` forgets the stage, as a new process would."""

    def __init__(self) -> None:
        self.stage, self.steps, self.version, self.orders = "", {}, 0, []
        self.down = 0

    def start_stage(self, name: str) -> TrainerStatus:
        self.orders.append(name)
        self.stage = name
        return self.status()

    def status(self) -> TrainerStatus:
        if self.down:
            self.down -= 1
            raise Down("trainer unreachable")
        if not self.stage:
            return TrainerStatus(policy_version=self.version)
        max_steps = next(s.max_steps for s in JOB.spec.stages if s.name == self.stage)
        if self.steps.get(self.stage, 0) < max_steps:
            self.steps[self.stage] = self.steps.get(self.stage, 0) + 1
            self.version += 1
        done = self.steps[self.stage] >= max_steps
        return TrainerStatus(step=sum(self.steps.values()), policy_version=self.version,
                             stage=self.stage, stage_step=self.steps[self.stage],
                             stage_max_steps=max_steps, stage_done=done)

    def restart(self) -> None:
        self.stage = ""


class FakeRollout:
    def __init__(self, trainer: FakeTrainer, behind: int = 0) -> None:
        self.trainer, self.mode, self.modes, self.evaluations = trainer, ModeRequest(), [], []
        self.behind = behind
        """Status polls during which the engine still serves version 0 (a resumed rollout
        before the trainer's weights arrive)."""
        self.versions_at_orders: list[int] = []

    def set_mode(self, mode: ModeRequest) -> RolloutStatus:
        self.mode = mode
        self.modes.append((mode.mode, mode.stage))
        self.versions_at_orders.append(self.status().policy_version)
        return self.status()

    def evaluate(self, task_set: str, *, samples: int, greedy: bool) -> Evaluation:
        self.evaluations.append(task_set)
        return Evaluation(self.trainer.version, 4, 0.5 + 0.1 * len(self.evaluations), 0.5, 0.1)

    def status(self) -> RolloutStatus:
        if self.behind:
            self.behind -= 1
            return RolloutStatus(self.mode.mode, self.mode.stage, policy_version=0)
        return RolloutStatus(self.mode.mode, self.mode.stage, policy_version=self.trainer.version)


class FakeBuffer:
    def status(self) -> FakeBufferStatus:
        return FakeBufferStatus()


def _driver(tmp_path: Path, trainer, rollout, *, job: RLJob = JOB, transient=(),
            unavailable_seconds: float = 600.0, **hooks) -> Driver:
    return Driver(job, ControlPlane(trainer, rollout, FakeBuffer()),
                  RunState.load(FileStore(tmp_path / "state.json")),
                  DriverHooks(**{"say": lambda s: None, **hooks}),
                  DriverOptions(poll_seconds=0.0, transient=transient,
                                unavailable_seconds=unavailable_seconds))


def test_stages_run_in_order_with_evaluations_kept(tmp_path: Path) -> None:
    trainer = FakeTrainer()
    rollout = FakeRollout(trainer)
    state = _driver(tmp_path, trainer, rollout).run()
    assert state.finished_stages == ["sft", "rl"]
    assert set(state.evaluations) == {"rl/before/h", "rl/after/h"}
    assert (RolloutMode.DEMONSTRATE, "sft") in rollout.modes and (RolloutMode.EXPLORE, "rl") in rollout.modes
    assert rollout.modes[-1] == (RolloutMode.IDLE, "")
    # A second driver on the same state does nothing again.
    again = FakeRollout(trainer)
    _driver(tmp_path, FakeTrainer(), again).run()
    assert again.modes == [] and again.evaluations == []


def test_a_resumed_rollout_gets_the_trainers_weights_before_any_episode(tmp_path: Path) -> None:
    trainer = FakeTrainer()
    trainer.version = 5  # resumed from a checkpoint; the rollout engine restarted at version 0
    rollout = FakeRollout(trainer, behind=3)
    _driver(tmp_path, trainer, rollout).run()
    # No order to produce (and no evaluation) went to a rollout still serving version 0.
    assert rollout.versions_at_orders and 0 not in rollout.versions_at_orders
    assert rollout.behind == 0


def test_an_evaluation_can_be_after_its_stage_only(tmp_path: Path) -> None:
    data = JOB.model_dump(by_alias=True)
    data["spec"]["stages"][1]["eval"]["before"] = False
    trainer = FakeTrainer()
    rollout = FakeRollout(trainer)
    driver = _driver(tmp_path, trainer, rollout, job=RLJob.model_validate(data))
    driver.run()
    assert list(driver.state.evaluations) == ["rl/after/h"]


def test_orders_are_repeated_to_a_restarted_trainer_and_rollout(tmp_path: Path) -> None:
    trainer = FakeTrainer()
    rollout = FakeRollout(trainer)
    polls = []

    def on_progress(p) -> None:
        polls.append(p.step)
        if len(polls) == 1:  # both services come back empty mid-stage
            trainer.restart()
            rollout.mode = ModeRequest()

    _driver(tmp_path, trainer, rollout, on_progress=on_progress).run()
    assert trainer.orders.count("sft") == 2
    assert rollout.modes.count((RolloutMode.DEMONSTRATE, "sft")) == 2
    assert trainer.steps == {"sft": 5, "rl": 2}  # the stage went on from where it was


def test_transient_errors_are_waited_out_and_a_stop_is_honoured(tmp_path: Path) -> None:
    trainer = FakeTrainer()
    trainer.down = 3
    state = _driver(tmp_path, trainer, FakeRollout(trainer), transient=(Down,)).run()
    assert state.finished_stages == ["sft", "rl"]
    trainer = FakeTrainer()
    trainer.down = 10 ** 6
    with pytest.raises(RuntimeError, match="unavailable"):
        _driver(tmp_path / "x" if (tmp_path / "x").mkdir() is None else tmp_path, trainer,
                FakeRollout(trainer), transient=(Down,), unavailable_seconds=0.05).run()
    stop = iter([False] * 3 + [True] * 100)
    trainer = FakeTrainer()
    (tmp_path / "y").mkdir()
    with pytest.raises(Stopped):
        _driver(tmp_path / "y", trainer, FakeRollout(trainer), should_stop=lambda: next(stop)).run()
    assert not RunState.load(FileStore(tmp_path / "y" / "state.json")).finished_stages


def test_a_service_down_during_a_call_is_restarted_and_given_its_orders(tmp_path: Path) -> None:
    """The trainer dies while the driver waits on it: the driver has it restarted from inside
    the wait (nothing else would), then gives the new process its stage again."""
    trainer = FakeTrainer()
    rollout = FakeRollout(trainer)
    polls, supervised = [], []

    def on_progress(p) -> None:
        polls.append(p.step)
        if len(polls) == 1:
            trainer.down = 10 ** 6  # dead until restarted

    def supervise() -> list[str]:
        if trainer.down:
            trainer.down = 0
            trainer.restart()
            supervised.append("trainer")
            return ["trainer"]
        return []

    events = []
    _driver(tmp_path, trainer, rollout, on_progress=on_progress, supervise=supervise,
            transient=(Down,), on_event=events.append, unavailable_seconds=5).run()
    assert supervised == ["trainer"]
    assert [e["services"] for e in events if e.get("event") == "restart"] == [["trainer"]]
    assert trainer.orders.count("sft") == 2 and trainer.steps == {"sft": 5, "rl": 2}


def test_a_stage_the_trainer_failed_ends_the_run_with_the_reason(tmp_path: Path) -> None:
    """A trainer that reports its stage failed ends the run (an error naming the stage and the
    trainer's reason), with that stage not recorded done: a rerun starts it again."""
    import dataclasses

    class Failing(FakeTrainer):
        def status(self) -> TrainerStatus:
            s = super().status()
            if self.stage == "rl" and self.steps.get("rl", 0) >= 1:
                return dataclasses.replace(s, stage_done=False, stage_failed=True,
                                           message="loss is nan")
            return s

    trainer = Failing()
    calls = iter(range(10 ** 6))
    with pytest.raises(RuntimeError, match="trainer failed in stage rl: loss is nan"):
        # A driver deaf to the failure would poll forever: stop it after a while.
        _driver(tmp_path, trainer, FakeRollout(trainer), should_stop=lambda: next(calls) > 500).run()
    assert RunState.load(FileStore(tmp_path / "state.json")).finished_stages == ["sft"]


def test_stage_evaluations_keep_and_track_pass_at_k(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from kiln.api.status import EvaluationResult
    from kiln.evaluation import TaskCount

    class CountingRollout(FakeRollout):
        def evaluate(self, task_set: str, *, samples: int, greedy: bool) -> Evaluation:
            # Two tasks of eval.samples (4) attempts: one solved once, one never.
            counts = [TaskCount("a", samples, 1, True), TaskCount("b", samples, 0, False)]
            return Evaluation(self.trainer.version, 2, 0.5, 1 / 8, 0.1, task_counts=counts)

    job = JOB.model_copy(deep=True)
    job.spec.stages[1].eval.samples = 4
    logged: dict[str, float] = {}
    trainer = FakeTrainer()
    state = _driver(tmp_path, trainer, CountingRollout(trainer), job=job,
                    tracker=SimpleNamespace(log=lambda step, values: logged.update(values))).run()
    after = state.evaluations["rl/after/h"]
    assert "task_counts" not in after
    assert after["pass_at_k"] == {"1": 1 / 8, "2": 0.25, "4": 0.5}
    assert logged["eval/h/pass_at_k/4"] == 0.5 and logged["eval/h/sampled_success"] == 1 / 8
    # What the operator writes into the RLJob's status.evaluations.
    assert EvaluationResult.model_validate(after).model_dump(by_alias=True)["passAtK"]["2"] == 0.25


def test_the_operators_driver_tracks_evaluations_and_progress(tmp_path: Path) -> None:
    """On a cluster the driver's tracker is the operator's (`job_tracker`): its TensorBoard
    event files, read back with TensorBoard's own reader, hold the evaluations and the job's
    progress at the trainer's global steps."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from kiln.operator.driving import job_tracker
    from kiln.operator.naming import JobRef

    trainer = FakeTrainer()
    tracker = job_tracker(JOB, JobRef(name="j", namespace="ns", uid="u"), tmp_path / "tracking")
    try:
        _driver(tmp_path, trainer, FakeRollout(trainer), tracker=tracker).run()
    finally:
        tracker.close()
    acc = EventAccumulator(str(tmp_path / "tracking" / "ns" / "j" / "driver"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"eval/h/greedy_success", "eval/h/sampled_success", "progress/stage_index",
            "progress/stage_step", "progress/steps_left", "rollout/mean_reward"} <= tags
    left = [(e.step, e.value) for e in acc.Scalars("progress/steps_left")]
    total = sum(s.max_steps for s in JOB.spec.stages)
    assert left[0][1] <= total and left[-1][1] == 0
    assert [e.value for e in acc.Scalars("progress/stage_index")][-1] == len(JOB.spec.stages) - 1
    # Evaluations before and after the RL stage, at the global step they were taken.
    assert len(acc.Scalars("eval/h/greedy_success")) == 2


def test_a_long_evaluation_tells_its_progress_while_it_runs() -> None:
    """`evaluate_reporting` (the driver's evaluation call): rollout's tasks-done figures are
    said every `every` seconds until Evaluate returns; its error is the caller's."""
    import threading

    from kiln.control.progress import evaluate_reporting

    class SlowRollout:
        """Evaluate returns once its progress has been asked for three times."""

        def __init__(self, fail: bool = False) -> None:
            self.polls, self.fail, self.asked = 0, fail, threading.Event()

        def status(self) -> RolloutStatus:
            self.polls += 1
            if self.polls == 2:
                raise Down("rollout restarting")  # a transient error: that report is skipped
            if self.polls >= 4:
                self.asked.set()
            return RolloutStatus(eval_tasks_done=self.polls, eval_tasks=8)

        def evaluate(self, task_set: str, *, samples: int, greedy: bool) -> Evaluation:
            assert self.asked.wait(60), "progress was never asked for"
            if self.fail:
                raise RuntimeError("Evaluate failed")
            return Evaluation(3, 8, 0.5, 0.25, 1.0)

    said: list[str] = []
    ev = evaluate_reporting(SlowRollout(), "h", samples=2, say=said.append, label="evaluating h",
                            transient=(Down,), every=0.01)
    assert ev.greedy_success == 0.5
    assert said[0] == "evaluating h"
    assert [s.strip().split(" (")[0] for s in said[1:4]] == ["evaluating h: 1/8 tasks done",
                                                     "evaluating h: 3/8 tasks done",
                                                     "evaluating h: 4/8 tasks done"]
    with pytest.raises(RuntimeError, match="Evaluate failed"):
        evaluate_reporting(SlowRollout(fail=True), "h", samples=2, say=said.append, label="x",
                           transient=(Down,), every=0.01)


def test_with_an_output_the_operators_driver_sends_its_scalars_to_the_trainer(tmp_path) -> None:
    """With `spec.output` the operator's driver hands its scalars to the trainer (which writes
    them to the output location, `test_trainer_servicer.py`), besides its own tracker; a
    trainer that cannot take them costs a gap in a plot, never the job."""
    from kiln.operator.driving import TrainerScalars

    class Recording:
        def __init__(self, fail: bool) -> None:
            self.fail, self.calls = fail, []

        def record_scalars(self, step: int, scalars: dict) -> None:
            if self.fail:
                raise Down("trainer unreachable")
            self.calls.append((step, scalars))

    class Inner:
        def __init__(self) -> None:
            self.calls, self.closed = [], False

        def log(self, step, scalars) -> None:
            self.calls.append(step)

        def close(self) -> None:
            self.closed = True

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    sink, inner = Recording(fail=False), Inner()
    tracker = TrainerScalars(sink, inner, "ns/j")
    trainer = FakeTrainer()
    _driver(tmp_path / "a", trainer, FakeRollout(trainer), tracker=tracker).run()
    tracker.close()
    evals = [(step, s["eval/h/greedy_success"]) for step, s in sink.calls
             if "eval/h/greedy_success" in s]
    assert [v for _, v in evals] == [0.6, 0.7]  # before and after the RL stage
    assert all(v is not None for _, s in sink.calls for v in s.values())
    left = [s["progress/steps_left"] for _, s in sink.calls if "progress/steps_left" in s]
    assert left[-1] == 0 and len(inner.calls) == len(sink.calls)
    assert inner.closed
    failing = TrainerScalars(Recording(fail=True), None, "ns/j")
    trainer = FakeTrainer()
    state = _driver(tmp_path / "b", trainer, FakeRollout(trainer), tracker=failing).run()
    assert state.finished_stages == ["sft", "rl"] and failing.failures > 0
