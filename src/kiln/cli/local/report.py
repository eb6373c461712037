"""What a finished run leaves behind: `summary.json` and `report/*.png`, from `metrics.jsonl`.

The summary holds the figures a user asks first: wall time, steps, final policy version, and
for each evaluation the held-out success rate (greedy and sampled); for a job with one SFT and
one RL stage also `heldout_success_before_rl` / `heldout_success_after_rl` (greedy) and, with
`eval.samples` > 1, `heldout_pass_at_k_before_rl` / `..._after_rl` (pass@k by k); for an
agent swarm's stage the held-out critical path before and after it, over every episode and over
the episodes that answered (`..._answered`: one that ran out of turns unanswered has the shortest
path, so a collapse must not read as a speed-up); for a guarded RL stage (`eval.select`,
`eval.stopOnRegression`) the step whose weights it ended with and why (`selections`).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kiln.api.spec import RLJob, RLStage
from kiln.cli.local.reward_report import plot_reward_parts, reward_parts


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
        "stages": [{"name": s.name, "type": s.type, **({"kind": s.kind} if getattr(s, "kind", None) else {})}
                   for s in job.spec.stages],
        "final_policy_version": last.get("policy_version", 0),
        "max_staleness": max((r["buffer"].get("max_staleness", 0) for r in recs), default=0),
        "dropped_stale": max((r["buffer"].get("dropped_stale", 0) for r in recs), default=0),
        # Greedy held-out success after each stage, {stage: {task set: success}}, in stage order;
        # every evaluation's details (before and after, sampled success, version, time) below.
        "evaluations": stage_evaluations(job, state.evaluations),
        "evaluation_details": state.evaluations,
    }
    if getattr(state, "selections", None):
        summary["selections"] = state.selections
    flips = [r["trainer"]["routing_flip_frac"] for _, r in steps_seen(recs)
             if r["trainer"].get("routing_flip_frac") is not None]
    if flips:
        # MoE with routing recorded: the share of (token, layer) pairs the trainer would have
        # routed differently from rollout, over the RL steps seen.
        summary["routing_flip_frac_mean"] = sum(flips) / len(flips)
        summary["routing_flip_frac_max"] = max(flips)
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
                if len(after.get("pass_at_k", {})) > 1:
                    # eval.samples > 1: held-out pass@k ({k: value}) before and after too.
                    summary.setdefault("heldout_pass_at_k_before_rl", before.get("pass_at_k", {}))
                    summary.setdefault("heldout_pass_at_k_after_rl", after["pass_at_k"])
                if getattr(stage, "swarm", None) is not None:
                    # Agent swarms: mean critical-path steps of the held-out episodes.
                    summary.setdefault("critical_path_steps_before_rl",
                                       before.get("critical_path_steps", 0.0))
                    summary.setdefault("critical_path_steps_after_rl",
                                       after.get("critical_path_steps", 0.0))
                    summary.setdefault("critical_path_steps_before_rl_answered",
                                       before.get("critical_path_steps_answered", 0.0))
                    summary.setdefault("critical_path_steps_after_rl_answered",
                                       after.get("critical_path_steps_answered", 0.0))
    _, parts = reward_parts(run_dir, {s.name for s in job.spec.stages if isinstance(s, RLStage)})
    if parts:
        # Each reward component's mean per RL stage (verifier, rules, outcome model, judge).
        summary["reward_parts"] = parts
    scoring = teacher_scoring(job, recs)
    if scoring:
        summary["teacher_scoring"] = scoring
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def teacher_scoring(job: RLJob, progress: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """What serving teachers cost each distillation stage: the seconds rollout's groups waited
    for their scores (summed over groups, which wait concurrently) and the tokens scored, beside
    the stage's wall time and the tokens rollout generated in it."""
    out: dict[str, dict[str, float]] = {}
    for stage in job.spec.stages:
        if not isinstance(stage, RLStage) or stage.rl.advantage != "opd":
            continue
        recs = [r for r in progress if r["stage"] == stage.name]
        if len(recs) < 2:
            continue
        first, last = recs[0]["rollout"], recs[-1]["rollout"]

        def grew(key: str) -> float:
            # A restarted rollout starts its counters again: then its latest figures alone.
            now, before = last.get(key) or 0, first.get(key) or 0
            return now - before if now >= before else now
        out[stage.name] = {
            "wait_seconds": round(grew("teacher_seconds"), 2),
            "tokens_scored": int(grew("teacher_tokens")),
            "tokens_generated": int(grew("tokens_generated")),
            "stage_wall_seconds": round(recs[-1]["time"] - recs[0]["time"], 1),
        }
    return out


def stage_evaluations(job: RLJob, evaluations: dict[str, dict[str, Any]]) -> dict[str, dict[str, float]]:
    """{stage: {task set: greedy success after the stage}} for the stages evaluated so far."""
    out: dict[str, dict[str, float]] = {}
    for stage in job.spec.stages:
        for task_set in (stage.eval.tasks if stage.eval else []):
            after = evaluations.get(f"{stage.name}/after/{task_set}")
            if after is not None:
                out.setdefault(stage.name, {})[task_set] = after["greedy_success"]
    return out


def steps_seen(progress: list[dict[str, Any]]) -> list[tuple[int, dict[str, Any]]]:
    """(global step, first progress record showing it) for every optimizer step the driver
    saw, in order. The driver polls about once a second, so a stage whose steps are faster is
    sampled rather than complete."""
    steps: dict[int, dict[str, Any]] = {}
    for r in progress:
        t = r["trainer"]
        if r.get("step") and t.get("stage") == r["stage"] and t.get("step") is not None:
            steps.setdefault(int(t["step"]), r)
    return sorted(steps.items())


def staleness_histogram(steps: list[tuple[int, dict[str, Any]]]) -> dict[int, float]:
    """Trajectories trained on, by how many policy versions their oldest token was behind the
    trainer, summed over `steps` (from `steps_seen`)."""
    hist: dict[int, float] = {}
    for _, r in steps:
        for k, v in (r["trainer"].get("staleness") or {}).items():
            hist[int(k)] = hist.get(int(k), 0.0) + v
    return dict(sorted(hist.items()))


def write_report(run_dir: Path, rl_stages: set[str] | None = None,
                 evaluations: dict[str, dict[str, float]] | None = None) -> list[Path]:
    """PNG plots: reward and pass rate per step, mask fractions, mismatch (per step), and a
    staleness histogram. With `rl_stages` the per-step plots show those stages' steps only (an
    SFT stage's "reward" is its demonstrations', and it has no masks or mismatch). With
    `evaluations` ({stage: {task set: success}}, the summary's) also `evaluations.png`: each held-out
    set's greedy success after each stage, the table of a chain of stages at a glance. And
    `reward_parts.png` where the RL stages' kept trajectories carry reward components."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = [r for r in _records(run_dir) if r.get("event") == "progress"]
    out_dir = run_dir / "report"
    out_dir.mkdir(exist_ok=True)
    written: list[Path] = []

    ordered = steps_seen(recs)
    if rl_stages is not None:
        ordered = [(x, r) for x, r in ordered if r["stage"] in rl_stages]

    def series(key_fn):
        pairs = [(x, key_fn(r)) for x, r in ordered]
        pairs = [(x, v) for x, v in pairs if v is not None]
        return [x for x, _ in pairs], [v for _, v in pairs]

    boundaries = [x for (x, r), (_, prev) in zip(ordered[1:], ordered) if r["stage"] != prev["stage"]]

    plots = {
        "reward.png": ("Reward and rollout pass rate per step", [
            ("train batch reward", lambda r: r["trainer"].get("reward_mean")),
            ("rollout pass rate (last 256)", lambda r: r["rollout"].get("mean_reward"))]),
        "masks.png": ("Masked token fractions (exclusive, and each mask in all)", [
            ("ratio only", lambda r: r["trainer"].get("ratio_only_frac")),
            ("IcePop only", lambda r: r["trainer"].get("icepop_only_frac")),
            ("both", lambda r: r["trainer"].get("both_masked_frac")),
            ("ratio (all)", lambda r: r["trainer"].get("ratio_mask_frac")),
            ("IcePop (all)", lambda r: r["trainer"].get("icepop_mask_frac"))]),
        "mismatch.png": ("Train/inference log-prob mismatch, and KL to a frozen model", [
            ("mean |diff|", lambda r: r["trainer"].get("mismatch_abs")),
            ("KL estimate", lambda r: r["trainer"].get("mismatch_kl")),
            ("KL to the reference (klCoef)", lambda r: r["trainer"].get("kl_ref") or None),
            ("KL to the teacher's top k (teacherTopK)",
             lambda r: r["trainer"].get("dense_kl") or None),
            ("MoE routing flips (fraction of token-layer pairs)",
             lambda r: r["trainer"].get("routing_flip_frac"))]),
    }
    for name, (title, lines) in plots.items():
        fig, ax = plt.subplots(figsize=(7, 3.5))
        for label, fn in lines:
            xs, ys = series(fn)
            if xs:
                ax.plot(xs, ys, label=label)
        for x in boundaries:
            ax.axvline(x, color="grey", linestyle=":", linewidth=1)
        ax.set_title(title)
        ax.set_xlabel("optimizer step (dotted: a new stage)")
        ax.legend(loc="best")
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=80)
        plt.close(fig)
        written.append(out_dir / name)

    hist = staleness_histogram(ordered)
    dropped = max((r["buffer"].get("dropped_stale") or 0 for r in recs), default=0)
    fig, ax = plt.subplots(figsize=(7, 3.5))
    if hist:
        ax.bar(list(hist), list(hist.values()), width=0.6)
        ax.set_xticks(sorted(hist))
    ax.set_title(f"Staleness of trained trajectories (dropped as stale: {dropped})")
    ax.set_xlabel("policy versions behind the trainer (oldest token)")
    ax.set_ylabel("trajectories (steps seen)")
    fig.tight_layout()
    fig.savefig(out_dir / "staleness.png", dpi=80)
    plt.close(fig)
    written.append(out_dir / "staleness.png")
    if evaluations:
        written.append(_plot_evaluations(plt, out_dir / "evaluations.png", evaluations))
    per_version, _ = reward_parts(run_dir, rl_stages or set())
    parts_png = plot_reward_parts(plt, out_dir / "reward_parts.png", per_version)
    return written + ([parts_png] if parts_png else [])


def _plot_evaluations(plt, path: Path, evaluations: dict[str, dict[str, float]]) -> Path:
    """Grouped bars: one group per stage (in stage order), one bar per held-out task set."""
    stages = list(evaluations)
    task_sets = list(dict.fromkeys(t for per in evaluations.values() for t in per))
    width = 0.8 / len(task_sets)
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for i, task_set in enumerate(task_sets):
        xs = [k + (i - (len(task_sets) - 1) / 2) * width for k, s in enumerate(stages)
              if task_set in evaluations[s]]
        ys = [evaluations[s][task_set] for s in stages if task_set in evaluations[s]]
        bars = ax.bar(xs, ys, width=width * 0.95, label=task_set)
        ax.bar_label(bars, fmt="%.2f", fontsize=8)
    ax.set_xticks(range(len(stages)), stages)
    ax.set_ylim(0, 1.1)
    ax.set_ylabel("greedy success")
    ax.set_title("Held-out success after each stage")
    ax.legend(loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path
