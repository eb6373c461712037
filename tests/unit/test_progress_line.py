"""`kiln run`'s progress line: the loss always, the reward and staleness only where they mean
something (RL steps), and every record appended to metrics.jsonl."""
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


def _line(tmp_path: Path, stage: int, step: StepMetrics | None) -> str:
    out = io.StringIO()
    shown = LocalProgress(tmp_path, out)
    st = JOB.spec.stages[stage]
    trainer = TrainerStatus(step=3, policy_version=1, stage=st.name, stage_step=3, last_step=step)
    buffer = BufferStatus(depth=0, ready=0, groups_pending=0, groups_ready=0, accepted=0, served=0,
                          dropped_stale=0, dropped_other=0, batches=0, max_staleness=2,
                          policy_version=1, capacity=10, group_size=2, tau=2)
    shown.progress(Progress(st, trainer, RolloutStatus(mean_reward=0.5), buffer, 9.0))
    return out.getvalue()


def test_supervised_steps_show_the_loss_and_no_reward(tmp_path: Path) -> None:
    line = _line(tmp_path, 0, StepMetrics(step=3, loss=1.25))
    assert "[sft] step 3/10" in line and "loss 1.2500" in line
    assert "reward" not in line and "staleness" not in line
    rec = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert rec["trainer"]["loss"] == 1.25 and rec["trainer"]["reward_mean"] is None


def test_rl_steps_show_reward_pass_rate_and_staleness(tmp_path: Path) -> None:
    line = _line(tmp_path, 1, StepMetrics(step=3, loss=0.5, reward_mean=0.75))
    assert "loss 0.5000" in line and "reward 0.750" in line
    assert "rollout pass 0.500" in line and "staleness<=2" in line
    assert "loss" not in _line(tmp_path, 1, None)  # no step of this stage yet
