"""How one step's metrics (`kiln.metrics.StepMetrics`) reach Prometheus: each field that
`kiln.metrics` gives a series is exported under it, generically, so a new step metric needs a
field there and nothing here.

Metrics are process-wide (the default registry), like the service that exports them; a test that
runs several engines in one process reads each step's values right after the step.
"""
from __future__ import annotations

import logging
import math

from kiln.metrics import STEP, StepMetrics
from kiln.services.common import metrics as common

log = logging.getLogger("kiln.trainer")

TOKENS_PER_SECOND = common.TRAINER_TOKENS_PER_SECOND
CHECKPOINT_SECONDS = common.CHECKPOINT_SECONDS
TRAINER_VERSION = common.POLICY_VERSION.labels(component="trainer")
NONFINITE_STEPS = common.NONFINITE_STEPS
FRESHNESS_TAU = common.FRESHNESS_TAU

_COLLECTORS = {
    "step": common.TRAIN_STEP, "policy_version": common.POLICY_VERSION,
    "loss": common.TRAIN_LOSS, "grad_norm": common.GRAD_NORM, "tokens": common.TRAIN_TOKENS,
    "step_seconds": common.STEP_SECONDS, "tokens_per_second": common.TRAINER_TOKENS_PER_SECOND,
    "wait_seconds": common.TRAINER_IDLE_SECONDS, "reward_mean": common.REWARD_MEAN,
    "ratio_mask_frac": common.RATIO_MASK_FRACTION, "icepop_mask_frac": common.ICEPOP_MASK_FRACTION,
    "mismatch_abs": common.MISMATCH_ABS, "mismatch_kl": common.MISMATCH_KL,
    "routing_flip_frac": common.ROUTING_FLIP_FRACTION,
    "ratio_only_frac": common.RATIO_ONLY_MASK_FRACTION,
    "icepop_only_frac": common.ICEPOP_ONLY_MASK_FRACTION,
    "both_masked_frac": common.BOTH_MASKS_FRACTION,
    "correction_mask_frac": common.CORRECTION_MASK_FRACTION,
    "routing_straddle_frac": common.ROUTING_STRADDLE_FRACTION,
    "kl_ref": common.KL_REF, "dense_kl": common.DENSE_KL,
}
"""The collector of every step field that has a series (a test checks this is all of them)."""


def observe_step(m: StepMetrics, stage: str) -> None:
    """Export one step's metrics under stage label `stage`. Fields the step did not measure
    (None: the drift gauges in a supervised step) leave their gauges at the last RL step."""
    labels = {"stage": stage, "component": "trainer"}
    for name, collector in _COLLECTORS.items():
        value = getattr(m, name)
        if value is None:
            continue
        metric = STEP[name]
        c = collector.labels(**{k: labels[k] for k in metric.labels}) if metric.labels else collector
        if metric.kind == "counter":
            c.inc(value)
        elif metric.kind == "histogram":
            c.observe(value)
        else:
            c.set(value)


def observe_stage_tau(stage: str, tau: int | None) -> None:
    """The freshness bound of the stage now running (what the buffer is configured with).
    Only the running stage's series exists, and none in a supervised stage (no bound): the
    alert KilnStalenessNearTau compares staleness with it, per job."""
    FRESHNESS_TAU.clear()
    if tau is not None:
        FRESHNESS_TAU.labels(stage=stage).set(tau)


def count_nonfinite(stage: str, loss: float, grad_norm: float) -> None:
    """An optimizer update skipped for a non-finite loss or gradient norm (the alert
    KilnTrainerNonFiniteSteps fires on it)."""
    reason = "loss" if not math.isfinite(loss) else "grad"
    NONFINITE_STEPS.labels(stage=stage, reason=reason).inc()
    log.error("stage %s: skipped an optimizer update: loss %s, gradient norm %s (not finite); "
              "the weights are unchanged", stage, loss, grad_norm)
