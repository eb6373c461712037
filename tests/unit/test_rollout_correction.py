"""Rollout correction (`rl.correction`): weights of the trainer's policy at the start of the step
to the inference policy, at the token, sequence and geometric level, truncated or masked, by
hand; every dropped token gets exactly zero gradient (hand-made and random batches); the spec
refuses what would weigh a token twice."""
from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError

from kiln.api.loss import Correction, MaskedLoss, PPOLoss
from kiln.api.rl import RLSettings
from kiln.services.trainer.loss import correction_weights, policy_loss

F64 = torch.float64
PPO = PPOLoss(mode="ppo", icepop_beta=None, eps_low=0.99, eps_high=100.0)  # no clip in play


def _batch():
    # Two trajectories of three trained tokens; log rho = old - infer per token:
    #   row 0: 0.1, 0.2, 1.5  (sum 1.8, mean 0.6)
    #   row 1: -0.1, 0.0, 0.1 (sum 0,   mean 0)
    old = torch.tensor([[-1.0, -1.0, -1.0, -1.0], [-2.0, -2.0, -2.0, -2.0]], dtype=F64)
    log_rho = torch.tensor([[0.0, 0.1, 0.2, 1.5], [0.0, -0.1, 0.0, 0.1]], dtype=F64)
    on = torch.tensor([[False, True, True, True], [False, True, True, True]])
    return old, old - log_rho, on


@pytest.mark.parametrize("level, mode, want_w, want_drop", [
    # token, truncate at 2: e^0.1, e^0.2, min(e^1.5, 2) = 2.
    ("token", "truncate", [[math.exp(0.1), math.exp(0.2), 2.0], [math.exp(-0.1), 1.0, math.exp(0.1)]],
     [[0, 0, 0], [0, 0, 0]]),
    # token, mask [1/2, 2]: e^1.5 = 4.48 is dropped; the others kept with weight 1.
    ("token", "mask", [[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]], [[0, 0, 1], [0, 0, 0]]),
    # sequence: row 0's product e^1.8 = 6.05 truncated to 2 / dropped; row 1's is 1.
    ("sequence", "truncate", [[2.0] * 3, [1.0] * 3], [[0, 0, 0], [0, 0, 0]]),
    ("sequence", "mask", [[0.0] * 3, [1.0] * 3], [[1, 1, 1], [0, 0, 0]]),
    # geometric: row 0's mean e^0.6 = 1.82, inside 2: kept whole, weighed 1.82 when truncating.
    ("geometric", "truncate", [[math.exp(0.6)] * 3, [1.0] * 3], [[0, 0, 0], [0, 0, 0]]),
    ("geometric", "mask", [[1.0] * 3, [1.0] * 3], [[0, 0, 0], [0, 0, 0]]),
])
def test_weights_and_masks_by_hand(level, mode, want_w, want_drop) -> None:
    old, infer, on = _batch()
    weight, dropped = correction_weights(old, infer, on, Correction(level=level, mode=mode, upper=2.0))
    assert weight[:, 0].tolist() == [0.0, 0.0]  # untrained tokens weigh nothing
    assert dropped[:, 0].tolist() == [False, False]
    assert weight[:, 1:][~dropped[:, 1:]].tolist() == pytest.approx(
        [w for row, d in zip(want_w, want_drop) for w, x in zip(row, d) if not x], rel=1e-12)
    assert dropped[:, 1:].int().tolist() == want_drop


def test_a_geometric_mask_drops_what_its_bounds_exclude() -> None:
    old, infer, on = _batch()
    _, dropped = correction_weights(old, infer, on, Correction(level="geometric", mode="mask", upper=1.5))
    assert dropped[:, 1:].int().tolist() == [[1, 1, 1], [0, 0, 0]]  # e^0.6 = 1.82 > 1.5
    _, low = correction_weights(old, infer, on, Correction(level="token", mode="mask", upper=1.5, lower=0.95))
    assert low[:, 1:].int().tolist() == [[0, 0, 1], [1, 0, 0]]  # e^-0.1 = 0.905 < 0.95


def test_the_loss_weighs_by_hand_and_dropped_tokens_get_zero_gradient() -> None:
    """ppo without IcePop, every ratio to the start of the step 1 (logp == old): each token's
    term is -A * w. Sequence mask: row 0 (product e^1.8) dropped whole, gradient exactly 0;
    token truncate: row 0's last token weighs 2."""
    old, infer, on = _batch()
    mask = on.to(F64)
    adv = torch.tensor([1.0, -1.0], dtype=F64)
    x = old.clone().requires_grad_(True)
    loss, stats = policy_loss(x, infer, mask, adv, PPO, logp_train_old=old,
                              correction=Correction(level="sequence", mode="mask", upper=2.0))
    assert loss.item() == pytest.approx((0.0 + 3 * 1.0) / 6, rel=1e-12)  # row 1: -(-1) * 1 each
    loss.backward()
    assert x.grad[0].tolist() == [0.0, 0.0, 0.0, 0.0]
    assert x.grad[1, 1:].tolist() == pytest.approx([1 / 6] * 3, rel=1e-12)
    d = stats.as_dict()
    assert d["correction_mask_frac"] == pytest.approx(0.5) and d["correction_weight_mean"] == 1.0
    assert d["kept_frac"] == pytest.approx(0.5)

    y = old.clone().requires_grad_(True)
    loss, stats = policy_loss(y, infer, mask, adv, PPO, logp_train_old=old,
                              correction=Correction(level="token", mode="truncate", upper=2.0))
    w0 = [math.exp(0.1), math.exp(0.2), 2.0]
    w1 = [math.exp(-0.1), 1.0, math.exp(0.1)]
    assert loss.item() == pytest.approx((-sum(w0) + sum(w1)) / 6, rel=1e-12)
    loss.backward()
    assert y.grad[0, 1:].tolist() == pytest.approx([-w / 6 for w in w0], rel=1e-12)
    assert stats.as_dict()["correction_weight_mean"] == pytest.approx((sum(w0) + sum(w1)) / 6)
    # Without a correction the step reports none of it.
    _, plain = policy_loss(old.clone(), infer, mask, adv, PPO, logp_train_old=old)
    assert "correction_mask_frac" not in plain.as_dict()


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
def test_every_dropped_token_has_exactly_zero_gradient_on_random_batches(level: str) -> None:
    g = torch.Generator().manual_seed(7)
    for loss_cfg in (PPOLoss(mode="ppo"), MaskedLoss()):
        if loss_cfg.mode == "masked" and level == "token":
            continue  # refused by the spec (test below)
        for _ in range(20):
            B, T = 4, 9
            logp = -torch.rand(B, T, generator=g, dtype=F64) * 3
            old = logp + torch.randn(B, T, generator=g, dtype=F64) * 0.05
            infer = old - torch.randn(B, T, generator=g, dtype=F64) * 0.6
            on = torch.rand(B, T, generator=g) > 0.3
            adv = torch.randn(B, generator=g, dtype=F64)
            c = Correction(level=level, mode="mask", upper=1.6)
            x = logp.clone().requires_grad_(True)
            loss, _ = policy_loss(x, infer, on.to(F64), adv, loss_cfg, logp_train_old=old, correction=c)
            loss.backward()
            _, dropped = correction_weights(old, infer, on, c)
            assert (x.grad[dropped] == 0).all()
            assert (x.grad[~on] == 0).all()
            assert torch.isfinite(x.grad).all()


def test_the_spec_refuses_a_token_weighed_twice() -> None:
    with pytest.raises(ValidationError, match="masked mode's ratio is already"):
        RLSettings.model_validate({"correction": {"level": "token", "mode": "mask"}})
    with pytest.raises(ValidationError, match="masked mode's ratio is already"):
        RLSettings.model_validate({"correction": {"level": "sequence", "mode": "truncate"}})
    with pytest.raises(ValidationError, match="IcePop already does"):
        RLSettings.model_validate({"loss": {"mode": "ppo"},
                                   "correction": {"level": "token", "mode": "truncate"}})
    with pytest.raises(ValidationError, match="lower applies to mode 'mask' only"):
        Correction.model_validate({"level": "token", "mode": "truncate", "lower": 0.5})
    ok = RLSettings.model_validate({"loss": {"mode": "ppo", "icepopBeta": None},
                                    "correction": {"level": "sequence", "mode": "truncate", "upper": 3}})
    assert ok.correction.upper == 3.0 and ok.correction.low == pytest.approx(1 / 3)
    assert RLSettings.model_validate({"correction": {"level": "geometric", "mode": "mask"}}).correction
