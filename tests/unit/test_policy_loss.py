"""The policy loss: each masking rule at its boundaries, aggregation by hand, and the property
that masked tokens get exactly zero gradient."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kiln.api.loss import MaskedLoss, PPOLoss
from kiln.services.trainer.loss import (
    icepop_keep_mask,
    loss_normalizer,
    policy_loss,
    ratio_keep_mask,
    sft_loss,
)

F64 = torch.float64


def _t(xs: list[float], dtype=F64) -> torch.Tensor:
    return torch.tensor([xs], dtype=dtype)


def _up(x: float) -> float:
    return math.nextafter(x, math.inf)


def _down(x: float) -> float:
    return math.nextafter(x, -math.inf)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_ratio_mask_bounds_are_inclusive(dtype: torch.dtype) -> None:
    lo, hi = math.log(1 - 0.2), math.log(1 + 0.28)
    # Exactly on each bound is kept; one ulp outside (in the tensor's dtype) is masked.
    on = torch.tensor([lo, hi], dtype=dtype)
    below = torch.nextafter(on[:1], torch.tensor([-math.inf], dtype=dtype))
    above = torch.nextafter(on[1:], torch.tensor([math.inf], dtype=dtype))
    logp = torch.cat([on, below, above, torch.zeros(1, dtype=dtype)])[None]
    keep = ratio_keep_mask(logp, torch.zeros_like(logp), eps_low=0.2, eps_high=0.28)
    assert keep.tolist() == [[True, True, False, False, True]]


def test_ratio_mask_uses_difference_not_absolute_values() -> None:
    logp_infer = _t([-3.0, -3.0, -0.5])
    logp = logp_infer + _t([math.log(0.9), math.log(1.5), math.log(0.7)])
    keep = ratio_keep_mask(logp, logp_infer, eps_low=0.2, eps_high=0.28)
    assert keep.tolist() == [[True, False, False]]


@pytest.mark.parametrize("beta", [2.0, 1.5, 5.0])
def test_icepop_bounds_are_inclusive(beta: float) -> None:
    lo, hi = math.log(1 / beta), math.log(beta)
    old = _t([lo, hi, _down(lo), _up(hi), 0.0])
    keep = icepop_keep_mask(old, torch.zeros_like(old), beta)
    assert keep.tolist() == [[True, True, False, False, True]]


def test_masked_mode_by_hand_token_mean() -> None:
    cfg = MaskedLoss(eps_low=0.2, eps_high=0.2)
    # Four trainable tokens and one prompt token:
    #  t0 ratio 1.1 kept; t1 ratio 1.5 masked by the ratio rule; t2 ratio 1.0 and rho = 3, kept
    #  (masked mode has no separate IcePop: its ratio is to pi_infer already); t3 ratio 0.9
    #  kept; t4 prompt (loss_mask 0).
    logp_infer = _t([-1.0, -1.0, -1.0, -1.0, -1.0])
    logp = logp_infer + _t([math.log(1.1), math.log(1.5), 0.0, math.log(0.9), 0.0])
    old = logp_infer + _t([0.0, 0.0, math.log(3.0), 0.0, 0.0])
    mask = _t([1, 1, 1, 1, 0])
    adv = torch.tensor([2.0], dtype=F64)
    loss, stats = policy_loss(logp, logp_infer, mask, adv, cfg, logp_train_old=old)
    # kept: t0, t2 and t3. token-mean over the 4 trainable tokens.
    expected = -(2.0 * 1.1 + 2.0 * 1.0 + 2.0 * 0.9) / 4
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    assert stats.tokens == 4 and stats.kept == 3
    assert stats.ratio_mask_frac == pytest.approx(1 / 4) and stats.icepop_mask_frac == 0.0
    assert stats.ratio_mean == pytest.approx((1.1 + 1.0 + 0.9) / 3)  # over kept tokens only
    assert stats.mismatch_abs == pytest.approx(math.log(3.0) / 4)
    assert stats.mismatch_kl == pytest.approx(((3.0 - 1) - math.log(3.0)) / 4)
    # masked mode has no IcePop to set: its variant refuses the field.
    with pytest.raises(ValueError, match="icepop_beta"):
        MaskedLoss(icepop_beta=2.0)


def test_ppo_mode_by_hand_clip_and_icepop() -> None:
    """ppo: ratio to pi_train_old under the clip, IcePop on pi_train_old / pi_infer as a mask
    and a weight. By hand, with A = +2 and eps 0.2:
      t0 r 1.1, rho 1   -> kept, gradient -A * r * rho = -2.2
      t1 r 1.5, rho 1   -> clipped (A > 0, r > 1.2): no gradient, loss term -1.2 * A
      t2 r 1.0, rho 3   -> IcePop drops it (beta 2)
      t3 r 0.5, rho 1.5 -> kept (the clip binds only above for A > 0), weighed by 1.5
      t4 r 1.0, rho 3   -> IcePop drops it too (the clip would have kept it)
    """
    cfg = PPOLoss(mode="ppo", eps_low=0.2, eps_high=0.2, icepop_beta=2.0)
    infer = _t([-1.0] * 5)
    old = infer + _t([0.0, 0.0, math.log(3.0), math.log(1.5), math.log(3.0)])
    logp = (old + _t([math.log(1.1), math.log(1.5), 0.0, math.log(0.5), 0.0])).requires_grad_(True)
    mask = _t([1, 1, 1, 1, 1])
    adv = torch.tensor([2.0], dtype=F64)
    loss, stats = policy_loss(logp, infer, mask, adv, cfg, logp_train_old=old)
    expected = -(2.0 * 1.1 * 1.0 + 1.2 * 2.0 * 1.0 + 0.5 * 2.0 * 1.5) / 5
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    loss.backward()
    assert logp.grad[0].tolist() == pytest.approx([-2.2 / 5, 0.0, 0.0, -0.5 * 2 * 1.5 / 5, 0.0])
    assert (stats.kept, stats.ratio_masked, stats.icepop_masked) == (2, 1, 2)
    assert (stats.ratio_only, stats.icepop_only, stats.both_masked) == (1, 2, 0)
    assert stats.ratio_mean == pytest.approx((1.1 + 0.5) / 2)


def test_ppo_dual_clip_bounds_negative_advantages() -> None:
    infer = _t([-1.0, -1.0])
    old = infer.clone()
    logp = (old + _t([math.log(4.0), math.log(1.1)])).requires_grad_(True)
    adv = torch.tensor([-1.0], dtype=F64)
    mask = _t([1, 1])
    plain = PPOLoss(mode="ppo", icepop_beta=None)
    dual = plain.model_copy(update={"dual_clip": 3.0})
    # Without the dual clip, r = 4 with A < 0 has gradient -A * r = 4 (the clip binds below).
    loss, _ = policy_loss(logp, infer, mask, adv, plain, logp_train_old=old)
    loss.backward()
    assert logp.grad[0].tolist() == pytest.approx([4.0 / 2, 1.1 / 2])
    logp.grad = None
    loss, stats = policy_loss(logp, infer, mask, adv, dual, logp_train_old=old)
    loss.backward()
    # max(min(rA, clip(r)A), 3A) = max(-4, -3) = -3: constant, no gradient; t1 unchanged.
    assert loss.item() == pytest.approx(-(-3.0 + -1.1) / 2)
    assert logp.grad[0].tolist() == pytest.approx([0.0, 1.1 / 2])
    assert stats.ratio_masked == 1 and stats.kept == 1
    with pytest.raises(ValueError, match="dual_clip"):
        MaskedLoss(dual_clip=3.0)


def test_icepop_changes_the_ppo_gradient_when_the_engine_drifts() -> None:
    """The same batch, the inference engine's log-probs drifted on some tokens (a different
    kernel, a stale weight): IcePop takes those tokens out and reweighs the rest, so the
    gradient differs from IcePop off; with no drift the two agree."""
    g = torch.Generator().manual_seed(3)
    old = -torch.rand(4, 16, generator=g, dtype=F64) * 2
    logp = old + torch.randn(4, 16, generator=g, dtype=F64) * 0.05
    mask = torch.ones(4, 16, dtype=F64)
    adv = torch.randn(4, generator=g, dtype=F64)
    drift = torch.zeros(4, 16, dtype=F64)
    drift[:, ::3] = 1.5  # rho = e^1.5 = 4.5 on every third token
    grads = {}
    for name, infer in (("same", old.clone()), ("drift", old - drift)):
        for beta in (2.0, None):
            x = logp.clone().requires_grad_(True)
            cfg = PPOLoss(mode="ppo", icepop_beta=beta)
            policy_loss(x, infer, mask, adv, cfg, logp_train_old=old)[0].backward()
            grads[name, beta] = x.grad
    assert torch.allclose(grads["same", 2.0], grads["same", None])
    assert not torch.allclose(grads["drift", 2.0], grads["drift", None])
    assert torch.all(grads["drift", 2.0][:, ::3] == 0)


def test_mismatch_metrics_stay_finite() -> None:
    """A log-ratio of 100 (float32 expm1 overflows past ~88) and a -inf inference log-prob on a
    prompt token: the KL estimate is finite and NaN-free; the loss too."""
    logp = torch.tensor([[-1.0, -1.0, -1.0]], dtype=torch.float32, requires_grad=True)
    infer = torch.tensor([[-101.0, float("-inf"), -1.0]], dtype=torch.float32)
    mask = torch.tensor([[1.0, 0.0, 1.0]])
    for cfg in (MaskedLoss(), PPOLoss(mode="ppo")):
        loss, stats = policy_loss(logp, infer, mask, torch.ones(1), cfg,
                                  logp_train_old=logp.detach())
        assert math.isfinite(stats.mismatch_kl) and math.isfinite(stats.mismatch_abs)
        assert stats.mismatch_abs == pytest.approx(20.0 / 2)  # clamped at LOG_RATIO_CLAMP
        assert torch.isfinite(loss)
        loss.backward()
        assert torch.isfinite(logp.grad).all()
        logp.grad = None


def test_policy_loss_seq_mean_by_hand() -> None:
    cfg = MaskedLoss(aggregation="sequence-mean")
    logp = torch.zeros(2, 3, dtype=F64)
    logp_infer = torch.zeros(2, 3, dtype=F64)
    mask = torch.tensor([[1, 1, 1], [0, 1, 0]], dtype=F64)
    adv = torch.tensor([1.0, -3.0], dtype=F64)
    loss, _ = policy_loss(logp, logp_infer, mask, adv, cfg)
    # Sequence 0: mean(-1,-1,-1) = -1; sequence 1: mean(+3) = 3; mean over sequences = 1.
    assert loss.item() == pytest.approx(1.0)
    token_cfg = cfg.model_copy(update={"aggregation": "token-mean"})
    loss_tok, _ = policy_loss(logp, logp_infer, mask, adv, token_cfg)
    assert loss_tok.item() == pytest.approx((-3 + 3) / 4)

    # Dr. GRPO: every token loss summed, over sequences x the constant length 10: (-3 + 3) / 20;
    # sequence 1's one token weighs as much as each of sequence 0's three.
    sum_cfg = cfg.model_copy(update={"aggregation": "sequence-sum"})
    adv = torch.tensor([1.0, -1.0], dtype=F64)
    loss_sum, _ = policy_loss(logp, logp_infer, mask, adv, sum_cfg, seq_sum_tokens=10)
    assert loss_sum.item() == pytest.approx((-3 + 1) / 20)
    # What each aggregation divides by, the one rule the engine uses too: 4 tokens, 2 sequences
    # with any, 2 sequences x 10.
    assert [loss_normalizer(mask, a, 10) for a in ("token-mean", "sequence-mean", "sequence-sum")] == [4.0, 2.0, 20.0]


def test_normalizer_splits_a_batch_into_micro_batches() -> None:
    torch.manual_seed(0)
    cfg = MaskedLoss()
    logp = torch.randn(4, 6, dtype=F64) * 0.1
    logp_infer = torch.randn(4, 6, dtype=F64) * 0.1
    mask = (torch.rand(4, 6) > 0.3).to(F64)
    adv = torch.randn(4, dtype=F64)
    whole, _ = policy_loss(logp, logp_infer, mask, adv, cfg)
    n = float(mask.sum())
    parts = [policy_loss(logp[i : i + 2], logp_infer[i : i + 2], mask[i : i + 2], adv[i : i + 2], cfg, normalizer=n)[0] for i in (0, 2)]
    assert (parts[0] + parts[1]).item() == pytest.approx(whole.item(), rel=1e-12)


def test_task_reward_weight_needs_opd() -> None:
    from kiln.api.spec import RLSettings

    assert RLSettings.model_validate({"advantage": "opd", "teacher": "a", "taskRewardWeight": 0.3}).task_reward_weight == 0.3
    with pytest.raises(ValueError, match="taskRewardWeight applies to advantage 'opd' only"):
        RLSettings.model_validate({"taskRewardWeight": 0.3})


def test_sampled_weight_needs_opd_and_something_left_to_learn() -> None:
    from kiln.api.spec import RLSettings

    dense_only = {"advantage": "opd", "teacher": "a", "sampledWeight": 0.0, "teacherTopK": 8}
    assert RLSettings.model_validate(dense_only).sampled_weight == 0.0
    with pytest.raises(ValueError, match="sampledWeight applies to advantage 'opd' only"):
        RLSettings.model_validate({"sampledWeight": 0.5})
    with pytest.raises(ValueError, match="nothing to learn from"):
        RLSettings.model_validate({"advantage": "opd", "teacher": "a", "sampledWeight": 0.0})


def test_ppo_needs_train_old_logprobs() -> None:
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="logp_train_old"):
        policy_loss(x, x, x, torch.zeros(1), PPOLoss(mode="ppo"))


def test_huge_log_ratio_on_masked_token_does_not_poison_gradient() -> None:
    logp = torch.tensor([[0.0, 500.0]], dtype=torch.float32, requires_grad=True)
    infer = torch.tensor([[0.0, -500.0]])
    loss, stats = policy_loss(logp, infer, torch.ones(1, 2), torch.ones(1), MaskedLoss())
    loss.backward()
    assert torch.isfinite(loss) and stats.ratio_masked == 1
    assert logp.grad.tolist() == [[-0.5, 0.0]]


def test_sft_loss_is_masked_nll() -> None:
    logp = torch.tensor([[-1.0, -2.0, -4.0]], requires_grad=True)
    loss, stats = sft_loss(logp, torch.tensor([[0, 1, 1]]))
    assert loss.item() == pytest.approx(3.0) and stats.tokens == 2
    loss.backward()
    assert logp.grad.tolist() == [[0.0, -0.5, -0.5]]


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    b=st.integers(1, 4),
    t=st.integers(1, 12),
    eps_low=st.floats(0.0, 0.9),
    eps_high=st.floats(0.0, 2.0),
    beta=st.one_of(st.none(), st.floats(1.01, 4.0)),
    aggregation=st.sampled_from(["token-mean", "sequence-mean"]),
    per_token_adv=st.booleans(),
)
def test_masked_tokens_get_exactly_zero_gradient(seed, b, t, eps_low, eps_high, beta, aggregation, per_token_adv) -> None:
    g = torch.Generator().manual_seed(seed)
    logp_infer = -torch.rand(b, t, generator=g, dtype=F64) * 3
    logp = (logp_infer + torch.randn(b, t, generator=g, dtype=F64) * 0.5).requires_grad_(True)
    old = logp_infer + torch.randn(b, t, generator=g, dtype=F64) * 0.5
    mask = (torch.rand(b, t, generator=g) > 0.3).to(F64)
    adv = torch.randn((b, t) if per_token_adv else (b,), generator=g, dtype=F64)
    adv = adv.masked_fill(adv.abs() < 1e-3, 1.0)  # a zero advantage would hide a kept token
    # masked mode: only the ratio to pi_infer decides.
    cfg = MaskedLoss(eps_low=eps_low, eps_high=eps_high, aggregation=aggregation)
    loss, stats = policy_loss(logp, logp_infer, mask, adv, cfg, logp_train_old=old)
    loss.backward()
    keep = mask.bool() & ratio_keep_mask(logp, logp_infer, eps_low, eps_high)
    grad = logp.grad
    assert torch.all(grad[~keep] == 0.0)
    assert torch.all(grad[keep] != 0.0)
    assert stats.kept == float(keep.sum())
    # ppo mode: IcePop and the clip (on the side the advantage pushes) decide.
    logp.grad = None
    ppo = PPOLoss(mode="ppo", eps_low=eps_low, eps_high=eps_high, icepop_beta=beta, aggregation=aggregation)
    loss, stats = policy_loss(logp, logp_infer, mask, adv, ppo, logp_train_old=old)
    loss.backward()
    a = adv if adv.dim() == 2 else adv[:, None].expand(b, t)
    r = torch.exp(logp.detach() - old)
    live = mask.bool()
    if beta is not None:
        live &= icepop_keep_mask(old, logp_infer, beta)
    clipped = ((a > 0) & (r > 1 + eps_high)) | ((a < 0) & (r < 1 - eps_low))
    keep = live & ~clipped
    assert torch.all(logp.grad[~keep] == 0.0)
    assert torch.all(logp.grad[keep] != 0.0)
    assert stats.kept == float(keep.sum())
