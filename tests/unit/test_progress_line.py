"""`kiln run`'s progress line: each stage type's own columns (SFT: loss, learning rate,
tokens/s; RL: loss, reward, pass rate, staleness, masked fractions), the whole job's ETA, every
record appended to metrics.jsonl, and the table printed at the end."""
from __future__ import annotations

import io
import json
from pathlib import Path

from kiln.api.spec import RLJob
from kiln.cli.local.progress import LocalProgress
from kiln.control import BufferStatus, RolloutStatus, TrainerStatus
from kiln.control.driver import Progress
from kiln.metrics import StepMetrics

JOB = RLJob.model_validate({
    "apiVersion": "kiln.dev/v1alpha1", "kind": "RLJob", "metadata": {"name": "p"},
    "spec": {"model": {"path": "m"}, "tasks": [{"name": "t", "env": "chain", "generate": {"count": 4}}],
             "stages": [{"name": "sft", "type": "sft", "tasks": ["t"], "maxSteps": 10},
                        {"name": "rl", "type": "rl", "tasks": ["t"], "maxSteps": 10,
                         "rl": {"groupSize": 2}}]}})


def _buffer(max_staleness: int = -1) -> BufferStatus:
    return BufferStatus(depth=0, ready=0, groups_pending=0, groups_ready=0, accepted=0, served=0,
                        dropped_stale=0, dropped_other=0, batches=0, max_staleness=max_staleness,
                        policy_version=1, capacity=10, group_size=2, tau=2)


def _line(tmp_path: Path, stage: int, step: StepMetrics | None) -> str:
    out = io.StringIO()
    shown = LocalProgress(tmp_path, out)
    st = JOB.spec.stages[stage]
    trainer = TrainerStatus(step=3, policy_version=1, stage=st.name, stage_step=3, last_step=step)
    shown.progress(Progress(st, trainer, RolloutStatus(mean_reward=0.5), _buffer(2), 9.0))
    return out.getvalue()


def test_supervised_steps_show_the_loss_and_no_reward(tmp_path: Path) -> None:
    line = _line(tmp_path, 0, StepMetrics(step=3, loss=1.25, lr=2e-5, tokens_per_second=812.0))
    assert "[sft] step 3/10" in line and "loss 1.2500" in line
    assert "lr 2.00e-05" in line and "812 train tok/s" in line
    assert "reward" not in line and "staleness" not in line and "pass" not in line
    rec = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert rec["trainer"]["loss"] == 1.25 and rec["trainer"]["reward_mean"] is None


def test_rl_steps_show_reward_pass_rate_and_staleness(tmp_path: Path) -> None:
    line = _line(tmp_path, 1, StepMetrics(step=3, loss=0.5, reward_mean=0.75, ratio_only_frac=0.01,
                                          icepop_only_frac=0.002, both_masked_frac=0.0))
    assert "loss 0.5000" in line and "reward 0.750" in line
    assert "pass 0.500" in line and "staleness<=2" in line
    assert "masked ratio 0.010 icepop 0.002 both 0.000" in line
    assert "loss" not in _line(tmp_path, 1, None)  # no step of this stage yet


def _progress(stage: int, stage_step: int, global_step: int) -> Progress:
    st = JOB.spec.stages[stage]
    trainer = TrainerStatus(step=global_step, stage=st.name, stage_step=stage_step,
                            last_step=StepMetrics(step=global_step, loss=1.0))
    return Progress(st, trainer, RolloutStatus(), _buffer(), 1.0)


def test_eta_counts_the_steps_left_in_every_later_stage(tmp_path: Path, monkeypatch) -> None:
    clock = [100.0]
    monkeypatch.setattr("kiln.cli.local.progress.time.monotonic", lambda: clock[0])
    shown = LocalProgress(tmp_path, io.StringIO(), JOB)
    assert shown.eta(_progress(0, 0, 0)) is None  # no pace yet
    for step in (1, 2, 3):  # a step every 2 s (of the clock above, not the test's)
        clock[0] += 2.0
        shown.progress(_progress(0, step, step))
    # 7 SFT steps and 10 RL steps left at 2 s a step.
    assert shown.eta(_progress(0, 3, 3)) == 34.0
    # Without the job only the stage itself counts.
    alone = LocalProgress(tmp_path, io.StringIO())
    alone._pace.extend([(0.0, 0), (4.0, 2)])
    assert alone.eta(_progress(1, 2, 12)) == 16.0


EVALUATED = RLJob.model_validate({**JOB.model_dump(by_alias=True, exclude_none=True), "spec": {
    **JOB.model_dump(by_alias=True, exclude_none=True)["spec"],
    "tasks": [{"name": "t", "env": "chain", "generate": {"count": 4}},
              {"name": "small", "env": "chain", "generate": {"count": 2}},
              {"name": "big", "env": "chain", "generate": {"count": 8}}],
    "stages": [{"name": "sft", "type": "sft", "tasks": ["t"], "maxSteps": 10,
                "eval": {"tasks": ["small"]}},
               {"name": "rl", "type": "rl", "tasks": ["t"], "maxSteps": 10, "rl": {"groupSize": 2},
                "eval": {"tasks": ["small", "big"], "every": 4}}]}})


def test_eta_counts_the_evaluations_still_to_come(tmp_path: Path, monkeypatch) -> None:
    from kiln.control.progress import evaluations_left

    # SFT at step 3: its "after" (small); RL: before, at steps 4 and 8, after, of both sets.
    assert sorted(evaluations_left(EVALUATED, "sft", 3)) == ["big"] * 4 + ["small"] * 5
    # RL at step 4: step 8 and after.
    assert sorted(evaluations_left(EVALUATED, "rl", 4)) == ["big"] * 2 + ["small"] * 2
    clock = [100.0]
    monkeypatch.setattr("kiln.cli.local.progress.time.monotonic", lambda: clock[0])
    shown = LocalProgress(tmp_path, io.StringIO(), EVALUATED)
    for step in (1, 2, 3):
        clock[0] += 2.0
        shown.progress(_progress(0, step, step))
    assert shown.eta(_progress(0, 3, 3)) == 34.0  # no evaluation has ended: steps only
    shown.event({"event": "eval", "task_set": "small", "seconds": 3.0})
    # 17 steps at 2 s; 5 of small at 3 s; big, never evaluated, at the mean of all (3 s) x 4.
    assert shown.eta(_progress(0, 3, 3)) == 34.0 + 15.0 + 12.0
    shown.event({"event": "eval", "task_set": "big", "seconds": 9.0})
    assert shown.eta(_progress(0, 3, 3)) == 34.0 + 15.0 + 36.0


def test_final_table_sums_up_each_stage(tmp_path: Path) -> None:
    from kiln.cli.local.progress import run_table

    shown = LocalProgress(tmp_path, io.StringIO(), JOB)
    shown.progress(_progress(0, 10, 10))
    st = JOB.spec.stages[1]
    trainer = TrainerStatus(step=14, stage="rl", stage_step=4,
                            last_step=StepMetrics(step=14, loss=0.25, reward_mean=0.625))
    shown.progress(Progress(st, trainer, RolloutStatus(), _buffer(), 1.0))
    (tmp_path / "state.json").write_text(json.dumps({"evaluations": {
        "rl/after/t": {"greedy_success": 0.875}}}))
    job = JOB.model_copy(deep=True)
    job.spec.stages[1].eval = type(job.spec.stages[1]).model_validate(
        {"name": "rl", "type": "rl", "tasks": ["t"], "eval": {"tasks": ["t"]}}).eval
    rows = run_table(job, tmp_path).splitlines()
    assert rows[0].split()[:5] == ["stage", "type", "steps", "loss", "reward"]
    assert rows[1].split() == ["sft", "sft", "10/10", "1.0000", "-", "-"]
    assert rows[2].split() == ["rl", "rl", "4/10", "0.2500", "0.625", "t", "0.875"]
