"""The policy-gradient losses (two modes) and the SFT loss.

Everything here is plain torch on `[B, T]` tensors aligned with the token sequence: entry `t`
is about token `t` (its log-prob given tokens `< t`). No Megatron, no model: the trainer engine
computes the log-probs and calls these functions, so the rules can be tested on hand-made
numbers.

Modes (DESIGN.md, "Training algorithms"; `mode` of the RLJob's `rl.loss`, `kiln.api.loss`, which
the trainer passes here as it is):
- `masked` (asynchronous agentic RL): `r_t = exp(logp - logp_infer)`, the ratio to the policy
  that generated the token; a token with `r_t` outside `[1 - eps_low, 1 + eps_high]` is dropped
  from the gradient (masked, not clipped); kept tokens contribute `-A_t * r_t`. No separate
  IcePop: `r_t` already measures the distance to the inference engine.
- `ppo` (reasoning RL): `r_t = exp(logp - logp_train_old)`, the ratio to the trainer's own
  weights at the start of the step, under PPO's clip (`-min(r A, clip(r) A)`, optionally
  dual-clipped at `c * A` for negative advantages); IcePop on
  `rho_t = exp(logp_train_old - logp_infer)`, the train/inference mismatch, masks tokens with
  `rho_t` outside `[1 / beta, beta]` and weighs the others by `rho_t`. The two ratios differ
  only when a step takes several minibatches (`logp_train_old` is then computed before the
  first update), or when the inference engine drifts from the trainer.

Both bounds of every window are inclusive. The comparisons are made in log space, with the
bounds rounded to the inputs' dtype, so a log-ratio equal to `log(bound)` in that dtype is on
the bound and kept.

Stats: each mask's fraction of the trainable tokens, exclusively too (dropped by the ratio
only, by IcePop only, by both), the ratio's mean over the tokens that carry gradient, and the
train/inference mismatch with log-ratios clamped to +-`LOG_RATIO_CLAMP` (and non-finite ones
left out), so the KL estimate stays finite and NaN-free whatever the engines disagree on.

Aggregation (`rl.loss.aggregation`): "token-mean" divides the summed token losses by the number
of loss-masked tokens (masked-out tokens still count, so dropping a token does not up-weight the
others); "sequence-mean" averages each sequence over its loss-masked tokens, then averages
sequences; "sequence-sum" (Dr. GRPO) sums every token loss and divides by sequences x
`seq_sum_tokens`, a constant (the longest a sequence may be), so no sequence's tokens weigh less
for its length. What is divided by is `loss_normalizer`'s, its one home: the engine takes it over
a whole minibatch and passes it as `normalizer`, so the micro-batches' accumulated gradients are
the minibatch's; without one, the (micro-)batch's own is taken.

KL penalty (`kl_coef` > 0, `rl.klCoef`, with `logp_ref`: a frozen reference's log-probs of the sampled
tokens): every trainable token's loss gets `kl_coef * (exp(d) - 1 - d)`, `d = logp_ref - logp`,
the k3 estimate of KL(pi_theta || pi_ref) (non-negative; unbiased for tokens sampled from
pi_theta itself, nearly so for the slightly stale samples of asynchronous RL), whatever the
masks did to its policy term (GRPO applies it so); `d` is clamped to
+-`LOG_RATIO_CLAMP` so a token the reference finds impossible does not overflow, and the estimate
at `kl_clamp` (`rl.klClamp`, 10 by default) so no one token outweighs the step. Rows without
reference log-probs get no penalty. Reported as `kl_ref`, the mean estimate per trained token.

Not covered: entropy bonuses, value functions.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from kiln.api.loss import Aggregation, Correction, Loss
# LOG_RATIO_CLAMP: log-ratios beyond it are clamped in the mismatch metrics, the KL estimate
# and the correction (its home).
from kiln.services.trainer.correction import LOG_RATIO_CLAMP, correction_weights, in_log_bounds
from kiln.services.trainer.distill import dense_kl


@dataclass
class LossStats:
    """Counts and sums over the loss-masked tokens of one (micro-)batch; add them up with
    `merge` and read the ratios as properties, so accumulated stats weigh tokens equally."""

    tokens: float = 0.0
    """Loss-masked (trainable) tokens."""
    kept: float = 0.0
    """Tokens that carry gradient (passed every mask, not clipped)."""
    ratio_masked: float = 0.0
    """Tokens the ratio rule took the gradient from (masked mode: outside the window; ppo:
    clipped)."""
    icepop_masked: float = 0.0
    ratio_only: float = 0.0
    icepop_only: float = 0.0
    both_masked: float = 0.0
    mismatch_abs_sum: float = 0.0
    """Sum of |logp_train_old - logp_infer| (clamped, finite tokens only)."""
    mismatch_kl_sum: float = 0.0
    """Sum of the k3 estimate of KL(pi_infer || pi_train_old): (rho - 1) - log(rho)."""
    ratio_sum: float = 0.0
    """Sum of `r_t` over the kept tokens."""
    kl_ref_sum: float = 0.0
    """Sum of the k3 estimate of KL(pi_theta || pi_ref) over the trainable tokens with a
    reference."""
    dense_kl_sum: float = 0.0
    """Sum of the dense distillation term (forward KL on the teacher's top k) over the
    trainable tokens that carry the teacher's top k."""
    sequences: float = 0.0
    routing_flips: float = 0.0
    """MoE with routing recorded: token-layer pairs where the trainer's own top-k differed from
    the rollout's (counted whether or not the rollout's was replayed)."""
    routing_compared: float = 0.0
    """Token-layer pairs compared for routing_flips."""
    corrected: float = 0.0
    """Trainable tokens that went through `rl.correction` (0: no correction configured)."""
    correction_masked: float = 0.0
    """Of those, tokens the correction's mask dropped (their trajectory's, at sequence level)."""
    correction_weight_sum: float = 0.0
    """Sum of the correction's weights over the tokens it did not drop."""

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
        """Mean `r_t` of the tokens that carry gradient (1.0 when none does)."""
        return self.ratio_sum / self.kept if self.kept else 1.0

    def as_dict(self) -> dict[str, float]:
        return {
            "tokens": self.tokens,
            "ratio_mask_frac": self.ratio_mask_frac,
            "icepop_mask_frac": self.icepop_mask_frac,
            "ratio_only_frac": self._frac(self.ratio_only),
            "icepop_only_frac": self._frac(self.icepop_only),
            "both_masked_frac": self._frac(self.both_masked),
            "kept_frac": self.kept_frac,
            "mismatch_abs": self.mismatch_abs,
            "mismatch_kl": self.mismatch_kl,
            "ratio_mean": self.ratio_mean,
            "kl_ref": self._frac(self.kl_ref_sum),
            "dense_kl": self._frac(self.dense_kl_sum),
            **({"routing_flip_frac": self.routing_flips / self.routing_compared}
               if self.routing_compared else {}),
            **({"correction_mask_frac": self.correction_masked / self.corrected,
                "correction_weight_mean": (self.correction_weight_sum / (self.corrected - self.correction_masked)
                                           if self.corrected > self.correction_masked else 1.0)}
               if self.corrected else {}),
        }


def ratio_keep_mask(logp: torch.Tensor, logp_infer: torch.Tensor, eps_low: float, eps_high: float) -> torch.Tensor:
    """True where `exp(logp - logp_infer)` lies in `[1 - eps_low, 1 + eps_high]`."""
    return in_log_bounds((logp - logp_infer).detach(), 1.0 - eps_low, 1.0 + eps_high)


def icepop_keep_mask(logp_train_old: torch.Tensor, logp_infer: torch.Tensor, beta: float) -> torch.Tensor:
    """True where `exp(logp_train_old - logp_infer)` lies in `[1/beta, beta]`."""
    return in_log_bounds((logp_train_old - logp_infer).detach(), 1.0 / beta, beta)


def _check_shapes(name_to_tensor: dict[str, torch.Tensor], shape: torch.Size) -> None:
    for name, t in name_to_tensor.items():
        if t.shape != shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)} like logp")


def loss_normalizer(loss_mask: torch.Tensor, aggregation: Aggregation, seq_sum_tokens: int) -> float:
    """What the summed losses of a batch are divided by under `aggregation` (module doc): its
    loss-masked tokens, its sequences with any, or its sequences x `seq_sum_tokens`."""
    if aggregation == "token-mean":
        return float(loss_mask.sum().clamp(min=1))
    if aggregation == "sequence-mean":
        return float((loss_mask.sum(dim=1) > 0).sum().clamp(min=1))
    if aggregation == "sequence-sum":
        return float(seq_sum_tokens * loss_mask.shape[0])
    raise ValueError(f"aggregation={aggregation!r} is not 'token-mean', 'sequence-mean' or 'sequence-sum'")


def _aggregate(
    per_token: torch.Tensor, mask: torch.Tensor, aggregation: Aggregation, normalizer: float | None,
    seq_sum_tokens: int = 1024,
) -> torch.Tensor:
    denom = normalizer if normalizer is not None else loss_normalizer(mask, aggregation, seq_sum_tokens)
    if aggregation == "sequence-mean":
        return (per_token.sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)).sum() / denom
    return per_token.sum() / denom


def policy_loss(
    logp: torch.Tensor,
    logp_infer: torch.Tensor,
    loss_mask: torch.Tensor,
    advantages: torch.Tensor,
    config: Loss,
    *,
    logp_train_old: torch.Tensor | None = None,
    normalizer: float | None = None,
    seq_sum_tokens: int = 1024,
    kl_coef: float = 0.0,
    kl_clamp: float | None = None,
    logp_ref: torch.Tensor | None = None,
    has_ref: torch.Tensor | None = None,
    dense_weight: float = 0.0,
    student_topk: torch.Tensor | None = None,
    teacher_topk: torch.Tensor | None = None,
    has_topk: torch.Tensor | None = None,
    correction: Correction | None = None,
) -> tuple[torch.Tensor, LossStats]:
    """The policy-gradient loss of one (micro-)batch in `config.mode`, and its stats.

    Shapes: `logp`, `logp_infer`, `loss_mask`, `logp_train_old`: `[B, T]`; `advantages`: `[B]`
    (one per sequence, broadcast to its tokens) or `[B, T]` (per token, e.g. OPD).
    `logp_train_old` is needed in ppo mode (with one minibatch per step, `logp.detach()`).
    `normalizer` (else `loss_normalizer` with `seq_sum_tokens`): see the module doc.
    `logp_ref` `[B, T]` and `has_ref` `[B]` (rows that have them): the reference's log-probs for
    the KL penalty, used when `kl_coef` > 0 (each token's estimate clamped at `kl_clamp`). `student_topk`, `teacher_topk` `[B, T, K]` and
    `has_topk` `[B]`: the student's and the teacher's log-probs of the teacher's top k, for the
    dense term (`dense_weight` > 0). The two weights are the stage's (`TrainerConfig.terms`),
    not the loss mode's. `correction` (`rl.correction`): rollout correction weights of the
    policy term (`correction_weights`), from `logp_train_old` (else `logp.detach()`).
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
    if config.mode == "ppo" and logp_train_old is None:
        raise ValueError("logp_train_old is required in ppo mode")
    old = logp_train_old.detach().to(logp.dtype) if logp_train_old is not None else None

    on = loss_mask.bool()
    stats = LossStats(tokens=float(mask.sum()), sequences=float((mask.sum(dim=1) > 0).sum()))
    if old is not None:
        _mismatch(stats, old - logp_infer, on)
    if config.mode == "masked":
        per_token, ratio_drop, ice_drop, keep, ratio = _masked(logp, logp_infer, on, adv, config)
    else:
        per_token, ratio_drop, ice_drop, keep, ratio = _ppo(logp, old, logp_infer, on, adv, config)
    if correction is not None:
        weight, dropped = correction_weights(old if old is not None else logp.detach(), logp_infer, on,
                                             correction)
        per_token = torch.where(dropped, torch.zeros_like(per_token), per_token * weight)
        keep = keep & ~dropped
        stats.corrected = float(on.sum())
        stats.correction_masked = float(dropped.sum())
        stats.correction_weight_sum = float((weight * (on & ~dropped)).sum())
    stats.ratio_masked = float(ratio_drop.sum())
    stats.icepop_masked = float(ice_drop.sum())
    stats.ratio_only = float((ratio_drop & ~ice_drop).sum())
    stats.icepop_only = float((ice_drop & ~ratio_drop).sum())
    stats.both_masked = float((ratio_drop & ice_drop).sum())
    stats.kept = float(keep.sum())
    stats.ratio_sum = float((ratio.detach() * keep).sum())
    if kl_coef and logp_ref is not None:
        _check_shapes({"logp_ref": logp_ref}, shape)
        rows = has_ref if has_ref is not None else torch.ones(shape[0], dtype=torch.bool)
        kl = kl_to_reference(logp, logp_ref.detach().to(logp.dtype), on & rows.to(on.device)[:, None],
                             kl_clamp)
        stats.kl_ref_sum = float(kl.detach().sum())
        per_token = per_token + kl_coef * kl
    if dense_weight and student_topk is not None:
        rows = has_topk.to(on.device) if has_topk is not None else torch.ones(shape[0], dtype=torch.bool)
        dense = dense_kl(student_topk, teacher_topk, on & rows[:, None])
        stats.dense_kl_sum = float(dense.detach().sum())
        per_token = per_token + dense_weight * dense
    loss = _aggregate(per_token, mask, config.aggregation, normalizer, seq_sum_tokens)
    return loss, stats


def kl_to_reference(logp: torch.Tensor, logp_ref: torch.Tensor, on: torch.Tensor,
                    clamp: float | None = None) -> torch.Tensor:
    """Per-token k3 estimate of KL(pi_theta || pi_ref), `exp(d) - 1 - d` with
    `d = logp_ref - logp` clamped to +-LOG_RATIO_CLAMP, then the estimate clamped at `clamp`
    (None: not); 0 where `on` is False. Differentiable in `logp`: a clamped token has gradient 0.

    Why the second clamp: k3 grows as exp(d), so at d = 20 one token's value and gradient are
    4.9e8, and after global gradient clipping that token alone steers the step. Clamping the
    estimate (verl's `low_var_kl`, slime: at 10) caps any token's share."""
    d = torch.where(on, (logp_ref - logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP), torch.zeros_like(logp))
    k3 = torch.expm1(d) - d
    if clamp is not None:
        k3 = k3.clamp(max=clamp)
    return torch.where(on, k3, torch.zeros_like(logp))


def _mismatch(stats: LossStats, log_rho: torch.Tensor, on: torch.Tensor) -> None:
    """Train/inference mismatch of the trainable tokens: finite tokens, clamped log-ratios."""
    ok = on & torch.isfinite(log_rho)
    lr = torch.where(ok, log_rho.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP), torch.zeros_like(log_rho))
    stats.mismatch_abs_sum = float(lr.abs().sum())
    stats.mismatch_kl_sum = float((torch.expm1(lr) - lr).sum())


def _masked(logp, logp_infer, on, adv, config):
    keep_ratio = ratio_keep_mask(logp, logp_infer, config.eps_low, config.eps_high)
    keep = on & keep_ratio
    # Select before exponentiating: a masked token may have a huge log-ratio, and exp(inf)
    # times a zero gradient would turn into NaN in the backward pass.
    ratio = torch.exp(torch.where(keep, logp - logp_infer, torch.zeros_like(logp)))
    per_token = torch.where(keep, -adv * ratio, torch.zeros_like(logp))
    return per_token, on & ~keep_ratio, torch.zeros_like(on), keep, ratio


def _ppo(logp, old, logp_infer, on, adv, config):
    zero = torch.zeros_like(logp)
    if config.icepop_beta is not None:
        keep_ice = icepop_keep_mask(old, logp_infer, config.icepop_beta)
    else:
        keep_ice = torch.ones_like(on)
    live = on & keep_ice
    ratio = torch.exp(torch.where(live, logp - old, zero))
    rho = torch.exp(torch.where(live, old - logp_infer, zero)) if config.icepop_beta is not None \
        else torch.ones_like(logp)
    lo, hi = 1.0 - config.eps_low, 1.0 + config.eps_high
    surrogate = torch.minimum(ratio * adv, ratio.clamp(lo, hi) * adv)
    r = ratio.detach()
    # Where the clip (or the dual clip) holds the surrogate constant, the token has no gradient.
    clipped = ((adv > 0) & (r > hi)) | ((adv < 0) & (r < lo))
    if config.dual_clip is not None:
        # For A < 0 the term is max(min(r A, clip(r) A), c A): constant once c A wins.
        floor = config.dual_clip * adv
        clipped = clipped | ((adv < 0) & (torch.minimum(r * adv, r.clamp(lo, hi) * adv) < floor))
        surrogate = torch.where(adv < 0, torch.maximum(surrogate, floor), surrogate)
    per_token = torch.where(live, -surrogate * rho, zero)
    ratio_drop = on & clipped
    keep = live & ~clipped
    return per_token, ratio_drop, on & ~keep_ice, keep, ratio


def sft_loss(
    logp: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    aggregation: Aggregation = "token-mean",
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
