"""What a finished run leaves behind: `summary.json` and `report/*.png`, from `metrics.jsonl`.

The summary holds the figures a user asks first: wall time, steps, final policy version, and
for each evaluation the held-out success rate (greedy and sampled); for a job with one SFT and
one RL stage also `heldout_success_before_rl` / `heldout_success_after_rl` (greedy).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kiln.api.spec import RLJob, RLStage


def _records(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def write_summary(job: RLJob, run_dir: Path, state, *, wall_seconds: float) -> dict[str, Any]:
    recs = [r for r in _records(run_dir) if r.get("event") == "progress"]
    last = recs[-1]["trainer"] if recs else {}
    steps = {}
    for r in recs:
        steps[r["stage"]] = max(steps.get(r["stage"], 0), r.get("step", 0))
    summary: dict[str, Any] = {
        "job": job.metadata.name,
        "wall_seconds": round(wall_seconds, 1),
        "steps": sum(steps.values()),
        "steps_per_stage": steps,
        "final_policy_version": last.get("version", 0),
        "max_staleness": max((r["buffer"].get("max_staleness", 0) for r in recs), default=0),
        "dropped_stale": max((r["buffer"].get("dropped_stale", 0) for r in recs), default=0),
        "evaluations": state.evaluations,
    }
    for stage in job.spec.stages:
        if not isinstance(stage, RLStage) or not stage.eval:
            continue
        for task_set in stage.eval.tasks:
            before = state.evaluations.get(f"{stage.name}/before/{task_set}")
            after = state.evaluations.get(f"{stage.name}/after/{task_set}")
            if before and after:
                summary.setdefault("heldout_success_before_rl", before["greedy_success"])
                summary.setdefault("heldout_success_after_rl", after["greedy_success"])
                summary.setdefault("heldout_sampled_success_before_rl", before["sampled_success"])
                summary.setdefault("heldout_sampled_success_after_rl", after["sampled_success"])
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def write_report(run_dir: Path) -> list[Path]:
    """PNG plots: reward and pass rate per step, staleness, mask fractions, mismatch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = [r for r in _records(run_dir) if r.get("event") == "progress"]
    out_dir = run_dir / "report"
    out_dir.mkdir(exist_ok=True)
    written: list[Path] = []

    def series(key_fn):
        xs, ys, seen = [], [], set()
        for i, r in enumerate(recs):
            v = key_fn(r)
            k = (r["stage"], r.get("step"))
            if v is None or k in seen or not r.get("step"):
                continue
            seen.add(k)
            xs.append(len(seen))
            ys.append(v)
        return xs, ys

    plots = {
        "reward.png": ("Reward and rollout pass rate per step", [
            ("train batch reward", lambda r: r["trainer"].get("reward")),
            ("rollout pass rate (last 256)", lambda r: r["rollout"].get("mean_reward"))]),
        "staleness.png": ("Staleness of trained trajectories", [
            ("max staleness served", lambda r: r["buffer"].get("max_staleness")),
            ("dropped stale (total)", lambda r: r["buffer"].get("dropped_stale"))]),
        "masks.png": ("Masked token fractions", [
            ("ratio mask", lambda r: r["trainer"].get("ratio_mask")),
            ("IcePop mask", lambda r: r["trainer"].get("icepop_mask"))]),
        "mismatch.png": ("Train/inference log-prob mismatch", [
            ("mean |diff|", lambda r: r["trainer"].get("mismatch_abs")),
            ("KL estimate", lambda r: r["trainer"].get("mismatch_kl"))]),
    }
    for name, (title, lines) in plots.items():
        fig, ax = plt.subplots(figsize=(7, 3.5))
        for label, fn in lines:
            xs, ys = series(fn)
            if xs:
                ax.plot(xs, ys, label=label)
        ax.set_title(title)
        ax.set_xlabel("optimizer step (all stages)")
        ax.legend(loc="best")
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=80)
        plt.close(fig)
        written.append(out_dir / name)
    return written
