"""The policy loss: each masking rule at its boundaries, aggregation by hand, and the property
that masked tokens get exactly zero gradient."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kiln.services.trainer.loss import (
    PolicyLossConfig,
    icepop_keep_mask,
    opd_advantages,
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


def test_policy_loss_by_hand_token_mean() -> None:
    cfg = PolicyLossConfig(eps_low=0.2, eps_high=0.2, icepop_beta=2.0)
    # Four trainable tokens and one prompt token:
    #  t0 ratio 1.1 kept; t1 ratio 1.5 masked by the ratio rule; t2 ratio 1.0 but rho = 3 so
    #  IcePop masks it; t3 ratio 0.9 kept; t4 prompt (loss_mask 0).
    logp_infer = _t([-1.0, -1.0, -1.0, -1.0, -1.0])
    logp = logp_infer + _t([math.log(1.1), math.log(1.5), 0.0, math.log(0.9), 0.0])
    old = logp_infer + _t([0.0, 0.0, math.log(3.0), 0.0, 0.0])
    mask = _t([1, 1, 1, 1, 0])
    adv = torch.tensor([2.0], dtype=F64)
    loss, stats = policy_loss(logp, logp_infer, mask, adv, cfg, logp_train_old=old)
    # kept: t0 and t3. token_mean over the 4 trainable tokens.
    expected = -(2.0 * 1.1 + 2.0 * 0.9) / 4
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    assert stats.tokens == 4 and stats.kept == 2
    assert stats.ratio_mask_frac == pytest.approx(1 / 4)
    assert stats.icepop_mask_frac == pytest.approx(1 / 4)
    assert stats.mismatch_abs == pytest.approx(math.log(3.0) / 4)
    assert stats.mismatch_kl == pytest.approx(((3.0 - 1) - math.log(3.0)) / 4)


def test_policy_loss_seq_mean_by_hand() -> None:
    cfg = PolicyLossConfig(icepop_beta=None, aggregation="seq_mean")
    logp = torch.zeros(2, 3, dtype=F64)
    logp_infer = torch.zeros(2, 3, dtype=F64)
    mask = torch.tensor([[1, 1, 1], [0, 1, 0]], dtype=F64)
    adv = torch.tensor([1.0, -3.0], dtype=F64)
    loss, _ = policy_loss(logp, logp_infer, mask, adv, cfg)
    # Sequence 0: mean(-1,-1,-1) = -1; sequence 1: mean(+3) = 3; mean over sequences = 1.
    assert loss.item() == pytest.approx(1.0)
    token_cfg = cfg.model_copy(update={"aggregation": "token_mean"})
    loss_tok, _ = policy_loss(logp, logp_infer, mask, adv, token_cfg)
    assert loss_tok.item() == pytest.approx((-3 + 3) / 4)


def test_normalizer_splits_a_batch_into_micro_batches() -> None:
    torch.manual_seed(0)
    cfg = PolicyLossConfig(icepop_beta=None)
    logp = torch.randn(4, 6, dtype=F64) * 0.1
    logp_infer = torch.randn(4, 6, dtype=F64) * 0.1
    mask = (torch.rand(4, 6) > 0.3).to(F64)
    adv = torch.randn(4, dtype=F64)
    whole, _ = policy_loss(logp, logp_infer, mask, adv, cfg)
    n = float(mask.sum())
    parts = [policy_loss(logp[i : i + 2], logp_infer[i : i + 2], mask[i : i + 2], adv[i : i + 2], cfg, normalizer=n)[0] for i in (0, 2)]
    assert (parts[0] + parts[1]).item() == pytest.approx(whole.item(), rel=1e-12)


def test_opd_advantage_is_per_token_and_stops_gradient() -> None:
    student = torch.tensor([[-1.0, -2.0]], dtype=F64, requires_grad=True)
    teacher = torch.tensor([[-0.5, -3.0]], dtype=F64)
    adv = opd_advantages(teacher, student)
    assert adv.tolist() == [[0.5, -1.0]] and not adv.requires_grad
    cfg = PolicyLossConfig(icepop_beta=None)
    loss, _ = policy_loss(student, student.detach(), torch.ones_like(student), adv, cfg)
    loss.backward()
    # ratio == 1, so d/dlogp (-A * r) = -A.
    assert student.grad.tolist() == [[-0.25, 0.5]]


def test_icepop_needs_train_old_logprobs() -> None:
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="logp_train_old"):
        policy_loss(x, x, x, torch.zeros(1), PolicyLossConfig(icepop_beta=2.0))


def test_huge_log_ratio_on_masked_token_does_not_poison_gradient() -> None:
    logp = torch.tensor([[0.0, 500.0]], dtype=torch.float32, requires_grad=True)
    infer = torch.tensor([[0.0, -500.0]])
    loss, stats = policy_loss(logp, infer, torch.ones(1, 2), torch.ones(1), PolicyLossConfig(icepop_beta=None))
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
    aggregation=st.sampled_from(["token_mean", "seq_mean"]),
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
    cfg = PolicyLossConfig(eps_low=eps_low, eps_high=eps_high, icepop_beta=beta, aggregation=aggregation)
    loss, stats = policy_loss(logp, logp_infer, mask, adv, cfg, logp_train_old=old)
    loss.backward()
    keep = mask.bool() & ratio_keep_mask(logp, logp_infer, eps_low, eps_high)
    if beta is not None:
        keep &= icepop_keep_mask(old, logp_infer, beta)
    grad = logp.grad
    assert torch.all(grad[~keep] == 0.0)
    assert torch.all(grad[keep] != 0.0)
    assert stats.kept == float(keep.sum())
