"""The policy-gradient loss with double-sided ratio masking and IcePop, and the SFT loss.

Everything here is plain torch on `[B, T]` tensors aligned with the token sequence: entry `t`
is about token `t` (its log-prob given tokens `< t`). No Megatron, no model: the trainer engine
computes the log-probs and calls these functions, so the masking rules can be tested on
hand-made numbers.

Rules (DESIGN.md, "Training algorithms"):
- ratio mask: `r_t = exp(logp - logp_infer)`; a token with `r_t` outside
  `[1 - eps_low, 1 + eps_high]` is dropped from the gradient (masked, not clipped);
- IcePop: `rho_t = exp(logp_train_old - logp_infer)`; a token is kept only if `rho_t` is in
  `[1 / beta, beta]`;
- the kept tokens contribute `-A_t * r_t`, whose gradient is the importance-weighted policy
  gradient `-A_t * r_t * grad(logp_t)`.

Both bounds are inclusive. The comparisons are made in log space, with the bounds rounded to the
inputs' dtype, so a log-ratio equal to `log(bound)` in that dtype is on the bound and kept.

Aggregation: "token_mean" divides the summed token losses by the number of loss-masked tokens
(masked-out tokens still count, so dropping a token does not up-weight the others);
"seq_mean" averages each sequence over its loss-masked tokens, then averages sequences. Pass
`normalizer` to divide by a count over the whole batch instead, when a batch is split into
micro-batches whose gradients are accumulated.

Not covered: KL-to-reference penalties, entropy bonuses, value functions.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Literal

import torch
from pydantic import BaseModel, Field

Aggregation = Literal["token_mean", "seq_mean"]


class PolicyLossConfig(BaseModel):
    """Knobs of the policy loss."""

    eps_low: float = Field(0.2, ge=0.0, lt=1.0)
    """Tokens with `r_t < 1 - eps_low` are masked out."""
    eps_high: float = Field(0.28, ge=0.0)
    """Tokens with `r_t > 1 + eps_high` are masked out."""
    icepop_beta: float | None = Field(2.0, gt=1.0)
    """Keep a token only if `pi_train_old / pi_infer` is in `[1/beta, beta]`; None disables."""
    aggregation: Aggregation = "token_mean"


@dataclass
class LossStats:
    """Counts and sums over the loss-masked tokens of one (micro-)batch; add them up with
    `merge` and read the ratios as properties, so accumulated stats weigh tokens equally."""

    tokens: float = 0.0
    """Loss-masked (trainable) tokens."""
    kept: float = 0.0
    """Tokens that passed every mask and carry gradient."""
    ratio_masked: float = 0.0
    icepop_masked: float = 0.0
    mismatch_abs_sum: float = 0.0
    """Sum of |logp_train_old - logp_infer|."""
    mismatch_kl_sum: float = 0.0
    """Sum of the k3 estimate of KL(pi_infer || pi_train_old): (rho - 1) - log(rho)."""
    ratio_sum: float = 0.0
    sequences: float = 0.0

    def merge(self, other: "LossStats") -> "LossStats":
        return LossStats(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})

    def _frac(self, x: float) -> float:
        return x / self.tokens if self.tokens else 0.0

    @property
    def ratio_mask_frac(self) -> float:
        return self._frac(self.ratio_masked)

    @property
    def icepop_mask_frac(self) -> float:
        return self._frac(self.icepop_masked)

    @property
    def kept_frac(self) -> float:
        return self._frac(self.kept)

    @property
    def mismatch_abs(self) -> float:
        return self._frac(self.mismatch_abs_sum)

    @property
    def mismatch_kl(self) -> float:
        return self._frac(self.mismatch_kl_sum)

    @property
    def ratio_mean(self) -> float:
        return self._frac(self.ratio_sum)

    def as_dict(self) -> dict[str, float]:
        return {
            "tokens": self.tokens,
            "ratio_mask_frac": self.ratio_mask_frac,
            "icepop_mask_frac": self.icepop_mask_frac,
            "kept_frac": self.kept_frac,
            "mismatch_abs": self.mismatch_abs,
            "mismatch_kl": self.mismatch_kl,
            "ratio_mean": self.ratio_mean,
        }


def _in_log_bounds(log_x: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """`low <= exp(log_x) <= high`, decided in log space in log_x's dtype (see module doc)."""
    lo = torch.tensor(math.log(low), dtype=log_x.dtype)
    hi = torch.tensor(math.log(high), dtype=log_x.dtype) if math.isfinite(high) else None
    ok = log_x >= lo
    if hi is not None:
        ok = ok & (log_x <= hi)
    return ok


def ratio_keep_mask(logp: torch.Tensor, logp_infer: torch.Tensor, eps_low: float, eps_high: float) -> torch.Tensor:
    """True where `exp(logp - logp_infer)` lies in `[1 - eps_low, 1 + eps_high]`."""
    return _in_log_bounds((logp - logp_infer).detach(), 1.0 - eps_low, 1.0 + eps_high)


def icepop_keep_mask(logp_train_old: torch.Tensor, logp_infer: torch.Tensor, beta: float) -> torch.Tensor:
    """True where `exp(logp_train_old - logp_infer)` lies in `[1/beta, beta]`."""
    return _in_log_bounds((logp_train_old - logp_infer).detach(), 1.0 / beta, beta)


def opd_advantages(logp_teacher: torch.Tensor, logp_student: torch.Tensor) -> torch.Tensor:
    """Per-token advantage of on-policy distillation: `stopgrad(logp_teacher - logp_student)`."""
    return (logp_teacher - logp_student).detach()


def _check_shapes(name_to_tensor: dict[str, torch.Tensor], shape: torch.Size) -> None:
    for name, t in name_to_tensor.items():
        if t.shape != shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)} like logp")


def _aggregate(
    per_token: torch.Tensor, mask: torch.Tensor, aggregation: Aggregation, normalizer: float | None
) -> torch.Tensor:
    if aggregation == "token_mean":
        denom = normalizer if normalizer is not None else mask.sum().clamp(min=1.0)
        return per_token.sum() / denom
    if aggregation == "seq_mean":
        seq_tokens = mask.sum(dim=1)
        seq_loss = per_token.sum(dim=1) / seq_tokens.clamp(min=1.0)
        denom = normalizer if normalizer is not None else (seq_tokens > 0).sum().clamp(min=1)
        return seq_loss.sum() / denom
    raise ValueError(f"aggregation={aggregation!r} is not 'token_mean' or 'seq_mean'")


def policy_loss(
    logp: torch.Tensor,
    logp_infer: torch.Tensor,
    loss_mask: torch.Tensor,
    advantages: torch.Tensor,
    config: PolicyLossConfig,
    *,
    logp_train_old: torch.Tensor | None = None,
    normalizer: float | None = None,
) -> tuple[torch.Tensor, LossStats]:
    """The masked policy-gradient loss of one (micro-)batch and its stats.

    Shapes: `logp`, `logp_infer`, `loss_mask`, `logp_train_old`: `[B, T]`; `advantages`: `[B]`
    (one per sequence, broadcast to its tokens) or `[B, T]` (per token, e.g. OPD).
    `logp_train_old` is needed when IcePop is on. `normalizer`: see the module doc.
    """
    shape = logp.shape
    mask = loss_mask.to(logp.dtype)
    checks = {"logp_infer": logp_infer, "loss_mask": loss_mask}
    if logp_train_old is not None:
        checks["logp_train_old"] = logp_train_old
    _check_shapes(checks, shape)
    if advantages.dim() == 1:
        if advantages.shape[0] != shape[0]:
            raise ValueError(f"advantages has {advantages.shape[0]} rows, logp has {shape[0]}")
        adv = advantages[:, None].expand(shape)
    else:
        _check_shapes({"advantages": advantages}, shape)
        adv = advantages
    adv = adv.detach().to(logp.dtype)
    logp_infer = logp_infer.detach().to(logp.dtype)

    on = loss_mask.bool()
    keep_ratio = ratio_keep_mask(logp, logp_infer, config.eps_low, config.eps_high)
    keep = on & keep_ratio
    stats = LossStats(tokens=float(mask.sum()), sequences=float((mask.sum(dim=1) > 0).sum()))
    stats.ratio_masked = float((on & ~keep_ratio).sum())
    if logp_train_old is not None:
        old = logp_train_old.detach().to(logp.dtype)
        log_rho = old - logp_infer
        stats.mismatch_abs_sum = float((log_rho.abs() * mask).sum())
        stats.mismatch_kl_sum = float(((torch.expm1(log_rho) - log_rho) * mask).sum())
    if config.icepop_beta is not None:
        if logp_train_old is None:
            raise ValueError("logp_train_old is required when icepop_beta is set")
        keep_ice = icepop_keep_mask(logp_train_old.to(logp.dtype), logp_infer, config.icepop_beta)
        stats.icepop_masked = float((on & ~keep_ice).sum())
        keep = keep & keep_ice
    stats.kept = float(keep.sum())

    # Select before exponentiating: a masked token may have a huge log-ratio, and exp(inf)
    # times a zero gradient would turn into NaN in the backward pass.
    log_ratio = torch.where(keep, logp - logp_infer, torch.zeros_like(logp))
    ratio = torch.exp(log_ratio)
    stats.ratio_sum = float((ratio.detach() * keep).sum())
    per_token = torch.where(keep, -adv * ratio, torch.zeros_like(logp))
    loss = _aggregate(per_token, mask, config.aggregation, normalizer)
    return loss, stats


def sft_loss(
    logp: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    aggregation: Aggregation = "token_mean",
    normalizer: float | None = None,
) -> tuple[torch.Tensor, LossStats]:
    """Cross-entropy (negative log-likelihood) of the loss-masked tokens."""
    _check_shapes({"loss_mask": loss_mask}, logp.shape)
    mask = loss_mask.to(logp.dtype)
    per_token = torch.where(loss_mask.bool(), -logp, torch.zeros_like(logp))
    loss = _aggregate(per_token, mask, aggregation, normalizer)
    tokens = float(mask.sum())
    stats = LossStats(tokens=tokens, kept=tokens, sequences=float((mask.sum(dim=1) > 0).sum()))
    return loss, stats
