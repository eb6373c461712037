"""Experiment tracking: scalars read back with TensorBoard's own event reader, the trainer's
step metrics under their tags, and a W&B run written in offline mode (no network)."""
from __future__ import annotations

import glob
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from kiln.api.spec import TrackingSpec, WandbSpec
from kiln.tracking import Tracker
from kiln.metrics import StepMetrics


def _scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_scalars_read_back(tmp_path: Path) -> None:
    t = Tracker(tmp_path / "tb", run_name="trainer", group="job")
    t.log(1, {"train/loss": 2.5, "train/lr": 1e-3})
    t.log(2, {"train/loss": 2.0, "skipped": None, "nan": float("nan")})
    t.close()
    assert glob.glob(str(tmp_path / "tb" / "events.out.tfevents.*"))
    got = _scalars(tmp_path / "tb")
    assert got["train/loss"] == [(1, 2.5), (2, 2.0)]
    assert got["train/lr"] == [(1, pytest.approx(1e-3))]
    assert "skipped" not in got and "nan" not in got


def test_tensorboard_off_writes_nothing(tmp_path: Path) -> None:
    t = Tracker(tmp_path / "tb", run_name="trainer", group="job",
                spec=TrackingSpec(tensorboard=False))
    t.log(1, {"train/loss": 1.0})
    t.close()
    assert not (tmp_path / "tb").exists()


def test_trainer_step_metrics_by_name() -> None:
    m = StepMetrics(step=3, loss=0.5, grad_norm=1.2, lr=1e-4, reward_mean=0.25,
                    ratio_mask_frac=0.01, icepop_mask_frac=0.0, kept_frac=0.99, mismatch_abs=1e-3,
                    mismatch_kl=1e-6, tokens_per_second=900.0, step_seconds=0.4, policy_version=2,
                    staleness={0: 6, 2: 2})
    rl = m.scalars(rl=True)
    assert rl["loss"] == 0.5 and rl["reward_mean"] == 0.25 and rl["step_seconds"] == 0.4
    assert rl["ratio_mask_frac"] == 0.01 and rl["mismatch_kl"] == 1e-6
    assert rl["staleness_mean"] == pytest.approx(0.5) and rl["staleness_max"] == 2
    assert "ratio_only_frac" not in rl  # not measured: no value, not a zero
    sft = m.scalars(rl=False)
    assert "loss" in sft and not any("mask" in k or "staleness" in k or "reward" in k for k in sft)


def test_wandb_offline_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    t = Tracker(tmp_path / "tb", run_name="trainer", group="job",
                spec=TrackingSpec(wandb=WandbSpec(mode="offline")), config={"lr": 1e-3})
    for step in range(3):
        t.log(step, {"train/loss": 1.0 / (step + 1)})
    t.close()
    # finish() only tells wandb's service process to close the run; the service writes the
    # .wandb file on its own time (at interpreter exit, wandb's atexit hook waits for it).
    # teardown() waits for the service to exit, so the file is complete when read below.
    wandb.teardown()
    runs = glob.glob(str(tmp_path / "tb" / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert len(runs) == 1
    assert b"train/loss" in Path(runs[0]).read_bytes()
    # TensorBoard is written alongside.
    assert [s for s, _ in _scalars(tmp_path / "tb")["train/loss"]] == [0, 1, 2]


def test_wandb_enabled_without_the_package_is_a_clear_error(monkeypatch: pytest.MonkeyPatch,
                                                            tmp_path: Path) -> None:
    import builtins

    real_import = builtins.__import__

    def no_wandb(name, *args, **kwargs):
        if name == "wandb":
            raise ModuleNotFoundError("No module named 'wandb'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_wandb)
    with pytest.raises(ValueError, match="spec.tracking.wandb is set but the `wandb` package"):
        Tracker(tmp_path / "tb", run_name="driver", group="job",
                spec=TrackingSpec(tensorboard=False, wandb=WandbSpec()))
