"""Rollout correction (`rl.correction`, `kiln.api.loss.Correction`): the per-token weights and
drops that `loss.policy_loss` applies to its policy term, from the ratio of the trainer's policy
at the start of the step to the inference policy, at the token, sequence or geometric level."""
from __future__ import annotations

import math

import torch

from kiln.api.loss import Correction

#: Log-ratios beyond this are clamped (here, and in `loss.py`'s mismatch metrics and KL
#: estimate): exp(20) is 5e8, far past any window or bound, and float32's expm1 overflows near 88.
LOG_RATIO_CLAMP = 20.0


def in_log_bounds(log_x: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """`low <= exp(log_x) <= high`, decided in log space in log_x's dtype (the window a ratio
    of that dtype is checked against, without overflowing exp). `loss.py`'s masks use it too."""
    lo = torch.tensor(math.log(low), dtype=log_x.dtype)
    hi = torch.tensor(math.log(high), dtype=log_x.dtype) if math.isfinite(high) else None
    ok = log_x >= lo
    if hi is not None:
        ok = ok & (log_x <= hi)
    return ok


def correction_weights(logp_train_old: torch.Tensor, logp_infer: torch.Tensor, on: torch.Tensor,
                       correction: Correction) -> tuple[torch.Tensor, torch.Tensor]:
    """The rollout correction of the trainable tokens `on` (`kiln.api.loss.Correction`): per
    token its weight (1 where nothing weighs) and whether the mask dropped it, both `[B, T]`.

    Decided in log space: the sequence level's product of ratios is a sum of log-ratios, which
    a long trajectory would overflow as a product. A log-ratio that is not finite (a token the
    inference engine gave probability 0) counts as +-LOG_RATIO_CLAMP, so a mask drops it and a
    truncation bounds it."""
    zero = torch.zeros_like(logp_infer)
    lr = torch.where(on, (logp_train_old - logp_infer).detach(), zero)
    lr = torch.nan_to_num(lr, nan=LOG_RATIO_CLAMP, posinf=LOG_RATIO_CLAMP,
                          neginf=-LOG_RATIO_CLAMP).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    if correction.level == "token":
        log_w = lr
    else:
        total = lr.sum(dim=1, keepdim=True)
        if correction.level == "geometric":
            total = total / on.sum(dim=1, keepdim=True).clamp(min=1)
        log_w = total.expand_as(lr)
    if correction.mode == "truncate":
        weight = torch.exp(log_w.clamp(max=math.log(correction.upper)))
        dropped = torch.zeros_like(on)
    else:
        weight = torch.ones_like(lr)
        dropped = on & ~in_log_bounds(log_w, correction.low, correction.upper)
    return torch.where(on, weight, zero), dropped
