"""The run report's per-step plots, drawn from step records: one home for both places that draw
them, `kiln run`/`kiln report` (from the driver's metrics.jsonl, `kiln.cli.local.report`) and
the trainer at the end of each stage on a cluster (from its own step log, into `spec.output`'s
`report/`, `kiln.services.trainer.output`).

A step record is `{"stage": name, "trainer": StepMetrics.record() and more, "rollout": {...},
"buffer": {...}}`; the trainer's own records have no rollout or buffer part, and the lines
that need them are left out. Torch-free; matplotlib is imported only when drawing.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

Step = tuple[int, dict[str, Any]]
"""(global optimizer step, its record)."""

#: name -> (title, [(line label, value of a record or None)]). `loss.png` shows every stage,
#: a line of its own each (SFT's cross-entropy and RL's policy loss are not one quantity); the
#: others the RL stages' steps.
LINES: dict[str, tuple[str, list[tuple[str, Callable[[dict[str, Any]], Any]]]]] = {
    "loss.png": ("Training loss per step", [
        ("loss", lambda r: r["trainer"].get("loss"))]),
    "reward.png": ("Reward and rollout pass rate per step", [
        ("train batch reward", lambda r: r["trainer"].get("reward_mean")),
        ("rollout pass rate (last 256)", lambda r: (r.get("rollout") or {}).get("mean_reward"))]),
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
        ("KL to the teacher's top k (teacherTopK)", lambda r: r["trainer"].get("dense_kl") or None),
        ("MoE routing flips (fraction of token-layer pairs)",
         lambda r: r["trainer"].get("routing_flip_frac"))]),
}


def staleness_histogram(steps: list[Step]) -> dict[int, float]:
    """Trajectories trained on, by how many policy versions their oldest token was behind the
    trainer, summed over `steps`."""
    hist: dict[int, float] = {}
    for _, r in steps:
        for k, v in (r["trainer"].get("staleness") or {}).items():
            hist[int(k)] = hist.get(int(k), 0.0) + v
    return dict(sorted(hist.items()))


def draw_steps(out_dir: Path, steps: list[Step], rl_stages: set[str] | None = None, *,
               dropped_stale: int = 0) -> list[Path]:
    """`loss.png` over every step, and over the steps of `rl_stages` (all steps when None)
    `reward.png`, `masks.png`, `mismatch.png` and `staleness.png`; returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    rl = steps if rl_stages is None else [(x, r) for x, r in steps if r["stage"] in rl_stages]
    written = []
    for name, (title, lines) in LINES.items():
        shown = steps if name == "loss.png" else rl
        fig, ax = plt.subplots(figsize=(7, 3.5))
        stages = list(dict.fromkeys(r["stage"] for _, r in shown)) if name == "loss.png" else [None]
        for stage in stages:
            for label, fn in lines:
                pairs = [(x, fn(r)) for x, r in shown if stage in (None, r["stage"])]
                pairs = [(x, v) for x, v in pairs if v is not None]
                if pairs:
                    ax.plot([x for x, _ in pairs], [v for _, v in pairs],
                            label=f"{label} ({stage})" if stage else label)
        for (x, r), (_, prev) in zip(shown[1:], shown):
            if r["stage"] != prev["stage"]:
                ax.axvline(x, color="grey", linestyle=":", linewidth=1)
        ax.set_title(title)
        ax.set_xlabel("optimizer step (dotted: a new stage)")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="best")
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=80)
        plt.close(fig)
        written.append(out_dir / name)

    hist = staleness_histogram(rl)
    fig, ax = plt.subplots(figsize=(7, 3.5))
    if hist:
        ax.bar(list(hist), list(hist.values()), width=0.6)
        ax.set_xticks(sorted(hist))
    ax.set_title(f"Staleness of trained trajectories (dropped as stale: {dropped_stale})")
    ax.set_xlabel("policy versions behind the trainer (oldest token)")
    ax.set_ylabel("trajectories (steps seen)")
    fig.tight_layout()
    fig.savefig(out_dir / "staleness.png", dpi=80)
    plt.close(fig)
    return written + [out_dir / "staleness.png"]
