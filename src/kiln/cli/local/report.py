"""What a finished run leaves behind: `summary.json` and `report/*.png`, from `metrics.jsonl`.
The report is drawn also when a run fails or is interrupted, and again by `kiln report RUN_DIR`
(`remake`); its per-step plots are `kiln.plots`'.

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
from kiln.plots import draw_steps


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
    summary.update(sync_sizes(job, run_dir))
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def sync_sizes(job: RLJob, run_dir: Path) -> dict[str, int]:
    """`weight_sync_bytes_per_version` (what the trainer's last publish carried: a LoRA job's
    adapter alone) and `model_bytes` (the policy's weights in the job's dtype), once a version
    was published."""
    record = run_dir / "trainer" / "weight_sync.json"
    model = job.spec.model.local_path()
    if not record.exists() or not any(model.glob("*.safetensors")):
        return {}
    from safetensors import safe_open

    width = {"float32": 4, "bfloat16": 2, "float16": 2}[job.spec.model.dtype]
    elements = 0
    for f in model.glob("*.safetensors"):
        with safe_open(str(f), "np") as st:
            for name in st.keys():
                shape = st.get_slice(name).get_shape()
                n = 1
                for d in shape:
                    n *= d
                elements += n
    return {"weight_sync_bytes_per_version": json.loads(record.read_text())["bytes_per_version"],
            "model_bytes": elements * width}


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


def write_report(run_dir: Path, rl_stages: set[str] | None = None,
                 evaluations: dict[str, dict[str, float]] | None = None) -> list[Path]:
    """PNG plots (`kiln.plots`): the loss per step over every stage; reward and pass rate, mask
    fractions and mismatch per step, and a staleness histogram. With `rl_stages` those show
    the RL stages' steps only (an SFT stage's "reward" is its demonstrations', and it has no
    masks or mismatch). With `evaluations` ({stage: {task set: success}}, the summary's) also
    `evaluations.png`: each held-out set's greedy success after each stage, the table of a
    chain of stages at a glance. And `reward_parts.png` where the RL stages' kept trajectories
    carry reward components."""
    recs = [r for r in _records(run_dir) if r.get("event") == "progress"]
    out_dir = run_dir / "report"
    dropped = max((r["buffer"].get("dropped_stale") or 0 for r in recs), default=0)
    written = draw_steps(out_dir, steps_seen(recs), rl_stages, dropped_stale=dropped)
    import matplotlib.pyplot as plt

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


def remake(run_dir: Path) -> list[Path]:
    """`report/*.png` of the run in `run_dir` from what it recorded (its job.yaml, metrics.jsonl
    and state.json's evaluations): at the end of a run, after one that failed or was
    interrupted, and for `kiln report`. ValueError naming the file when job.yaml is missing or
    not a job."""
    import yaml

    from kiln.control.driver import FileStore

    job_file = run_dir / "job.yaml"
    if not job_file.is_file():
        raise ValueError(f"{job_file}: not there; a `kiln run` run directory holds its job.yaml")
    try:
        job = RLJob.model_validate(yaml.safe_load(job_file.read_text()))
    except Exception as exc:  # yaml or pydantic: either way not the job a run writes
        raise ValueError(f"{job_file}: not an RLJob a run wrote: {exc}") from exc
    if not (run_dir / "metrics.jsonl").is_file():
        raise ValueError(f"{run_dir / 'metrics.jsonl'}: not there; the run recorded no progress")
    evaluations = FileStore(run_dir / "state.json").load().get("evaluations", {})
    return write_report(run_dir, rl_stages={s.name for s in job.spec.stages if s.type != "sft"},
                        evaluations=stage_evaluations(job, evaluations))
