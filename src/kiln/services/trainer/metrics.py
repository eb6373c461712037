"""The trainer's Prometheus metrics: the shared ones of `kiln.services.common.metrics` (the names
the Grafana dashboard and alert rules use), and how one step's numbers reach them.

Metrics are process-wide (the default registry), like the service that exports them; a test that
runs several engines in one process reads each step's values right after the step.
"""
from __future__ import annotations

from kiln.services.common import metrics as common

TOKENS_PER_SECOND = common.TRAINER_TOKENS_PER_SECOND
CHECKPOINT_SECONDS = common.CHECKPOINT_SECONDS
TRAINER_VERSION = common.POLICY_VERSION.labels(component="trainer")


def observe_step(m: dict[str, float], stage: str, *, rl: bool) -> None:
    """Export one step's metrics (the dict `TrainerEngine.step` returns) under stage label
    `stage`; `rl` is False for supervised steps."""
    common.TRAIN_STEP.labels(stage=stage).set(m["step"])
    common.TRAIN_LOSS.labels(stage=stage).set(m["loss"])
    common.GRAD_NORM.set(m["grad_norm"])
    common.TRAIN_TOKENS.inc(m["tokens"])
    common.STEP_SECONDS.observe(m["step_time_s"])
    TOKENS_PER_SECOND.set(m["tokens_per_s"])
    TRAINER_VERSION.set(m["policy_version"])
    if rl:
        common.REWARD_MEAN.set(m["reward_mean"])
        # SFT has no inference log-probs; leave the drift gauges showing the last RL step.
        common.RATIO_MASK_FRACTION.set(m["ratio_mask_frac"])
        common.ICEPOP_MASK_FRACTION.set(m["icepop_mask_frac"])
        common.MISMATCH_ABS.set(m["mismatch_abs"])
        common.MISMATCH_KL.set(m["mismatch_kl"])
        if "routing_flip_frac" in m:
            common.ROUTING_FLIP_FRACTION.set(m["routing_flip_frac"])


#: Tracked per step (TensorBoard / W&B tag -> key of the step's metrics).
TRACKED = {
    "train/loss": "loss", "train/grad_norm": "grad_norm", "train/lr": "lr",
    "train/reward": "reward_mean", "train/ratio_mask_frac": "ratio_mask_frac",
    "train/icepop_mask_frac": "icepop_mask_frac", "train/kept_frac": "kept_frac",
    "train/ratio_only_frac": "ratio_only_frac", "train/icepop_only_frac": "icepop_only_frac",
    "train/both_masked_frac": "both_masked_frac", "train/ratio_mean": "ratio_mean",
    "train/mismatch_abs": "mismatch_abs", "train/mismatch_kl": "mismatch_kl",
    "train/kl_ref": "kl_ref", "train/dense_kl": "dense_kl",
    "train/tokens_per_s": "tokens_per_s", "train/step_seconds": "step_time_s",
    "train/policy_version": "policy_version", "train/routing_flip_frac": "routing_flip_frac",
}


def tracked_scalars(m: dict[str, float], *, rl: bool) -> dict[str, float]:
    """The step's metrics under their tracking tags; the off-policy ones (masks, mismatch,
    staleness) for RL steps only, where they mean something."""
    off_policy = ("mask", "mismatch", "kept", "only", "ratio_mean", "routing", "kl_ref", "dense_kl")
    out = {tag: m[key] for tag, key in TRACKED.items()
           if key in m and (rl or not any(w in key for w in off_policy))}
    counts = {int(k.removeprefix("staleness_")): v for k, v in m.items()
              if k.startswith("staleness_")}
    if rl and counts:
        n = sum(counts.values())
        out["train/staleness_mean"] = sum(k * v for k, v in counts.items()) / n
        out["train/staleness_max"] = max(counts)
    return out
