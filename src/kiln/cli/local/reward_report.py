"""The reward's components in a run's report: each `reward_parts` entry (the verifier, rules,
outcome model, judge, PARL's parts) averaged per RL stage and per policy version, from the
trajectories rollout keeps (`rollout/trajectories.jsonl`, every `rollout.sampleEvery`-th).

`summary.json: reward_parts` holds {stage: {part: mean}}; `report/reward_parts.png` plots each
part's mean against the policy version the trajectory was sampled at (its newest token's).
Swarm measurements (`swarm/...`: counts and steps, not rewards) are left out.
"""
from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path


def _samples(run_dir: Path, stages: set[str]):
    path = run_dir / "rollout" / "trajectories.jsonl"
    if not path.exists():
        return
    for line in path.read_text().splitlines():
        try:
            t = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a kill
        if t.get("stage") in stages:
            yield t


def reward_parts(run_dir: Path, stages: set[str]):
    """({stage: {policy version: {part: mean}}}, {stage: {part: mean}}) over the kept
    trajectories of `stages`."""
    per_version: dict = defaultdict(lambda: defaultdict(lambda: defaultdict(lambda: [0.0, 0])))
    per_stage: dict = defaultdict(lambda: defaultdict(lambda: [0.0, 0]))
    for t in _samples(run_dir, stages):
        version = max((s["policy_version"] for s in t.get("version_spans", [])), default=0)
        for part, value in t.get("reward_parts", {}).items():
            if part.startswith("swarm/"):
                continue
            for acc in (per_version[t["stage"]][version][part], per_stage[t["stage"]][part]):
                acc[0] += value
                acc[1] += 1
    return ({stage: {v: {p: s / n for p, (s, n) in parts.items()} for v, parts in sorted(per.items())}
             for stage, per in per_version.items()},
            {stage: {p: round(s / n, 4) for p, (s, n) in sorted(parts.items())}
             for stage, parts in per_stage.items()})


def plot_reward_parts(plt, path: Path, per_version: dict[str, dict[int, dict[str, float]]]) -> Path | None:
    """One line per (stage, part): its mean per policy version. None when there is nothing."""
    lines = [(f"{stage}: {part}" if len(per_version) > 1 else part,
              [(v, parts[part]) for v, parts in per.items() if part in parts])
             for stage, per in per_version.items()
             for part in sorted({p for parts in per.values() for p in parts})]
    if not lines:
        return None
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for label, points in lines:
        ax.plot([v for v, _ in points], [y for _, y in points], marker=".", label=label)
    ax.set_title("Reward components per policy version (kept trajectories)")
    ax.set_xlabel("policy version sampled at")
    ax.set_ylabel("mean score")
    ax.legend(loc="best", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path
