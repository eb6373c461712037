"""An RL stage's guard rails through the stage driver, against a scripted trainer and rollout:
the held-out score rises then falls, the best checkpoint is kept, a regression stops the stage
with its reason, and the next stage starts from the selected weights. Also the rules alone
(`kiln.control.guard`) and the spec's refusals."""
from __future__ import annotations

from pathlib import Path

import pytest

from kiln.api.spec import RLJob
from kiln.control import Evaluation, ModeRequest, RolloutStatus, TrainerStatus
from kiln.control.driver import ControlPlane, Driver, DriverHooks, DriverOptions, FileStore, RunState
from kiln.control.guard import Guard

from helpers.fakes import FakeBufferStatus


def _job(guard: dict, *, max_steps: int = 12, tasks=("h",)) -> RLJob:
    return RLJob.model_validate({
        "apiVersion": "kiln.dev/v1alpha1", "kind": "RLJob", "metadata": {"name": "g"},
        "spec": {"model": {"path": "m"},
                 "tasks": [{"name": "t", "env": "chain", "generate": {"count": 4}},
                           *({"name": n, "env": "chain", "generate": {"count": 4, "split": "heldout"}}
                             for n in ("h", "h2"))],
                 "stages": [{"name": "rl", "type": "rl", "tasks": ["t"], "maxSteps": max_steps,
                             "batchSize": 8, "microBatchSize": 8, "rl": {"groupSize": 8},
                             "eval": {"tasks": list(tasks), **guard}},
                            {"name": "next", "type": "rl", "tasks": ["t"], "maxSteps": 1,
                             "batchSize": 8, "microBatchSize": 8, "rl": {"groupSize": 8}}]}})


GUARDED = {"every": 2, "select": {"metric": "greedy_success", "mode": "max"},
           "stopOnRegression": {"metric": "greedy_success", "drop": 0.15, "patience": 2}}


class ScriptedTrainer:
    """One step per status poll; the weights are named by (stage, step) they come from. A
    guarded stage waits at every `every` steps (checkpointed) until `continue_stage`."""

    def __init__(self, job: RLJob) -> None:
        self.job = job
        self.stage, self.steps, self.version, self.weights = "", {}, 0, ("init", 0)
        self.held, self.checkpoints, self.kept, self.restored = 0, {}, [], []
        self.started_from: dict[str, tuple[str, int]] = {}
        self.selected: tuple[int, str] | None = None

    def _stage(self):
        return next(s for s in self.job.spec.stages if s.name == self.stage)

    def start_stage(self, name: str) -> TrainerStatus:
        if name != self.stage:
            self.stage, self.held, self.selected = name, 0, None
            self.started_from[name] = self.weights
            self.checkpoints = {0: self.weights}
        return self.status()

    def status(self) -> TrainerStatus:
        if not self.stage:
            return TrainerStatus(policy_version=self.version)
        stage, n = self._stage(), self.steps.get(self.stage, 0)
        every = stage.eval.every if stage.eval else None
        if not self.held and self.selected is None and n < stage.max_steps:
            n = self.steps[self.stage] = n + 1
            self.version += 1
            self.weights = (self.stage, n)
            if every and n % every == 0 and n < stage.max_steps:
                self.held, self.checkpoints[n] = n, self.weights
        return TrainerStatus(step=sum(self.steps.values()), policy_version=self.version,
                             stage=self.stage, stage_step=n, stage_max_steps=stage.max_steps,
                             stage_done=self.selected is not None or n >= stage.max_steps,
                             stage_eval_step=self.held,
                             stage_selected_step=self.selected and self.selected[0],
                             stage_selected_reason=self.selected[1] if self.selected else "")

    def continue_stage(self, name: str, step: int, keep_step: int) -> TrainerStatus:
        assert keep_step in self.checkpoints, "kept a step that has no checkpoint"
        self.kept.append((step, keep_step))
        if self.held == step:
            self.held = 0
        return self.status()

    def restore_checkpoint(self, name: str, step: int, reason: str) -> TrainerStatus:
        self.restored.append(step)
        self.weights, self.held, self.selected = self.checkpoints[step], 0, (step, reason)
        self.version += 1  # published as a new version
        return self.status()


class ScriptedRollout:
    """Held-out success of the weights it serves: `scores[task set][weights' stage step]`."""

    def __init__(self, trainer: ScriptedTrainer, scores: dict[str, dict[int, float]]) -> None:
        self.trainer, self.scores, self.mode = trainer, scores, ModeRequest()
        self.evaluated: list[tuple[str, tuple[str, int]]] = []

    def set_mode(self, mode: ModeRequest) -> RolloutStatus:
        self.mode = mode
        return self.status()

    def evaluate(self, task_set: str, *, samples: int, greedy: bool) -> Evaluation:
        stage, step = self.trainer.weights
        self.evaluated.append((task_set, (stage, step)))
        value = self.scores[task_set][step] if stage == "rl" or stage == "init" else 0.0
        return Evaluation(self.trainer.version, 4, value, value / 2, 0.1)

    def status(self) -> RolloutStatus:
        return RolloutStatus(self.mode.mode, self.mode.stage, policy_version=self.trainer.version)


class _Buffer:
    def status(self) -> FakeBufferStatus:
        return FakeBufferStatus()


def _run(tmp_path: Path, job: RLJob, scores) -> tuple[Driver, ScriptedTrainer, ScriptedRollout, list]:
    trainer = ScriptedTrainer(job)
    rollout = ScriptedRollout(trainer, scores)
    events: list[dict] = []
    driver = Driver(job, ControlPlane(trainer, rollout, _Buffer()),
                    RunState.load(FileStore(tmp_path / "state.json")),
                    DriverHooks(say=lambda s: None, on_event=events.append),
                    DriverOptions(poll_seconds=0.0))
    driver.run()
    return driver, trainer, rollout, events


RISE_THEN_FALL = {"h": {0: 0.3, 2: 0.5, 4: 0.9, 6: 0.7, 8: 0.6, 10: 0.4, 12: 0.3}}


def test_a_regression_stops_the_stage_on_its_best_checkpoint(tmp_path: Path) -> None:
    driver, trainer, rollout, events = _run(tmp_path, _job(GUARDED), RISE_THEN_FALL)
    state = driver.state
    # Evaluated at 0 (before), 2, 4, 6, 8: 0.7 and 0.6 are more than 0.15 below 0.9 twice.
    assert [k for k in state.evaluations if k.startswith("rl/step-")] == \
        ["rl/step-2/h", "rl/step-4/h", "rl/step-6/h", "rl/step-8/h"]
    assert trainer.steps["rl"] == 8 and trainer.restored == [4]
    # The best checkpoint so far was the one kept at every evaluation.
    assert trainer.kept == [(2, 2), (4, 4), (6, 4)]
    sel = state.selections["rl"]
    assert sel["step"] == 4 and sel["stopped"]
    assert "regression" in sel["reason"] and "0.900" in sel["reason"] and "step 4" in sel["reason"]
    assert [e for e in events if e["event"] == "selection"][0]["step"] == 4
    # "after" is the evaluation of the weights the stage ends with.
    assert state.evaluations["rl/after/h"]["greedy_success"] == 0.9
    assert rollout.evaluated[-1] == ("h", ("rl", 4))
    # The next stage starts from them.
    assert trainer.started_from["next"] == ("rl", 4)
    assert state.finished_stages == ["rl", "next"]


def test_without_a_regression_the_best_step_is_selected_at_the_end(tmp_path: Path) -> None:
    guard = {"every": 2, "select": {"metric": "greedy_success"}}
    driver, trainer, rollout, _ = _run(tmp_path, _job(guard), RISE_THEN_FALL)
    assert trainer.steps["rl"] == 12 and trainer.restored == [4]
    sel = driver.state.selections["rl"]
    assert sel == {"step": 4, "stopped": False, "reason": sel["reason"]}
    assert "0.900 at step 4" in sel["reason"] and "last step (12)" in sel["reason"]
    # The last step's evaluation is kept as step-12; "after" is of the selected weights.
    assert driver.state.evaluations["rl/step-12/h"]["greedy_success"] == 0.3
    assert driver.state.evaluations["rl/after/h"]["greedy_success"] == 0.9
    assert trainer.started_from["next"] == ("rl", 4)


def test_a_last_step_that_is_best_is_kept_without_a_restore(tmp_path: Path) -> None:
    rising = {"h": {s: s / 12 for s in range(13)}}
    driver, trainer, _, _ = _run(tmp_path, _job({"every": 4, "select": {}}), rising)
    assert trainer.restored == [] and driver.state.selections["rl"]["step"] == 12
    assert trainer.started_from["next"] == ("rl", 12)


def test_every_alone_evaluates_inside_the_stage_and_selects_nothing(tmp_path: Path) -> None:
    driver, trainer, _, _ = _run(tmp_path, _job({"every": 5}), RISE_THEN_FALL | {"h": {
        s: 0.5 for s in range(13)}})
    assert [k for k in driver.state.evaluations if "/step-" in k] == ["rl/step-5/h", "rl/step-10/h"]
    assert trainer.restored == [] and driver.state.selections == {}


def test_a_two_skill_stage_selects_by_the_lower_skill(tmp_path: Path) -> None:
    # Skill h rises all along; skill h2 is best early and then forgotten.
    scores = {"h": {s: 0.2 + s / 20 for s in range(13)}, "h2": {s: 0.8 - s / 20 for s in range(13)}}
    guard = {"every": 2, "select": {"metric": "greedy_success", "taskSets": ["h", "h2"]}}
    driver, trainer, _, _ = _run(tmp_path, _job(guard, tasks=("h", "h2")), scores)
    # min(h, h2) peaks where they cross: step 6 (0.5, 0.5).
    assert driver.state.selections["rl"]["step"] == 6 and trainer.restored == [6]
    assert "lowest of h, h2" in driver.state.selections["rl"]["reason"]


def test_the_rules_alone() -> None:
    spec = _job({"every": 1, "select": {},
                 "stopOnRegression": {"drop": 0.2, "patience": 2}}).spec.stages[0].eval
    guard = Guard(spec)
    ev = lambda v: {"h": {"greedy_success": v, "sampled_success": 0.0}}  # noqa: E731
    assert guard.observe(0, ev(0.5)) is None and guard.observe(1, ev(0.8)) is None
    assert guard.observe(2, ev(0.55)) is None  # one fall: patience 2
    assert guard.observe(3, ev(0.7)) is None   # back within 0.2 of the best: the count restarts
    assert guard.observe(4, ev(0.5)) is None
    stop = guard.observe(5, ev(0.1))
    assert stop is not None and stop.stopped and stop.step == 1
    # Ties go to the later step.
    tie = Guard(spec)
    for step, v in enumerate((0.5, 0.9, 0.9)):
        tie.observe(step, ev(v))
    assert tie.best() == (2, 0.9)


@pytest.mark.parametrize("guard,stage_type,message", [
    ({"select": {}}, "rl", "need `every`"),
    ({"every": 2, "select": {"taskSets": ["nope"]}}, "rl", "select.taskSets"),
    ({"every": 2}, "sft", "for RL stages"),
])
def test_bad_guard_rails_are_refused(guard, stage_type, message) -> None:
    data = _job({}).model_dump(by_alias=True, exclude_none=True)
    stage = data["spec"]["stages"][0]
    stage["eval"].update(guard)
    if stage_type == "sft":
        data["spec"]["stages"][0] = {k: v for k, v in stage.items()
                                     if k in ("name", "tasks", "maxSteps", "batchSize",
                                              "microBatchSize", "eval")} | {"type": "sft"}
    with pytest.raises(ValueError, match=message):
        RLJob.model_validate(data)


def test_the_wire_keeps_a_selected_step_0_and_the_answered_critical_path() -> None:
    from kiln.control import wire

    for selected in (None, 0, 7):
        s = TrainerStatus(stage="rl", stage_eval_step=3, stage_selected_step=selected,
                          stage_selected_reason="why" if selected is not None else "")
        assert wire.trainer_status_from_proto(wire.trainer_status_to_proto(s)) == s
    ev = Evaluation(3, 50, 0.0, 0.0, 1.0, critical_path_steps=9.0, critical_path_steps_answered=0.0)
    assert wire.evaluation_from_proto(wire.evaluation_to_proto(ev)) == ev
