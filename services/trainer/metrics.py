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
