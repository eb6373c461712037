"""The KL penalty to a reference (`rl.klCoef`, `rl.reference`): the k3 term by hand and its
gradient, rows without reference log-probs left alone, finiteness far from the reference, and
the spec's rules (what goes together, what is served, what the operator refuses)."""
from __future__ import annotations

import math

import pytest
import torch

from kiln.api.loss import MaskedLoss
from kiln.services.trainer.loss import kl_to_reference, policy_loss

F64 = torch.float64


def test_kl_penalty_by_hand_and_its_gradient() -> None:
    cfg = MaskedLoss()
    logp = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -1.0, -1.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=F64)
    d = torch.tensor([[0.5, -0.3, 4.0], [1.0, 1.0, 1.0]], dtype=F64)  # logp_ref - logp
    ref = logp + d
    has_ref = torch.tensor([True, False])  # the second row was not scored: no penalty
    adv = torch.tensor([1.0, -1.0], dtype=F64)
    x = logp.clone().requires_grad_(True)
    loss, stats = policy_loss(x, logp, mask, adv, cfg, kl_coef=0.5, logp_ref=ref, has_ref=has_ref)
    k3 = [math.exp(v) - 1 - v for v in (0.5, -0.3)]  # the prompt token (mask 0) carries none
    # Every ratio is 1 (logp == logp_infer): policy terms -A per trained token; token-mean / 5.
    expected = (-(1.0 * 2) - (-1.0 * 3) + 0.5 * sum(k3)) / 5
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    assert stats.as_dict()["kl_ref"] == pytest.approx(sum(k3) / 5)
    loss.backward()
    # d/dlogp [0.5 (exp(ref - logp) - 1 - (ref - logp))] = 0.5 (1 - exp(d)); plus -A * r.
    want = torch.tensor([[-1 + 0.5 * (1 - math.exp(0.5)), -1 + 0.5 * (1 - math.exp(-0.3)), 0.0],
                         [1.0, 1.0, 1.0]], dtype=F64) / 5
    assert torch.allclose(x.grad, want, rtol=1e-12)


def test_no_coefficient_no_penalty_and_the_estimate_stays_finite() -> None:
    logp = torch.tensor([[-1.0, -3.0]], dtype=F64)
    mask = torch.ones(1, 2, dtype=F64)
    adv = torch.tensor([1.0], dtype=F64)
    ref = torch.tensor([[-1.0, 0.0]], dtype=F64)
    plain, _ = policy_loss(logp, logp, mask, adv, MaskedLoss())
    ignored, stats = policy_loss(logp, logp, mask, adv, MaskedLoss(), logp_ref=ref)
    assert plain.item() == ignored.item() and stats.kl_ref_sum == 0.0
    # Identical to the reference: no penalty; a token the reference finds impossible (-inf),
    # or far more likely, stays finite (the log-ratio is clamped at +-20).
    on = torch.ones(1, 3, dtype=torch.bool)
    same = kl_to_reference(torch.tensor([[-1.0, -1.0, -1.0]]), torch.tensor([[-1.0, -math.inf, 100.0]]), on)
    assert same[0, 0].item() == 0.0 and torch.isfinite(same).all() and (same >= 0).all()


def test_the_estimate_is_clamped_so_no_token_dominates() -> None:
    """k3 at d = 6 is e^6 - 7 = 396.4, with gradient 1 - e^6 = -402.4: clamped at 10 (the
    default, verl's and slime's) the token adds 10 and no gradient; below the clamp nothing
    changes; `rl.klClamp: null` keeps the raw estimate."""
    from kiln.api.spec import RLSettings
    from kiln.services.trainer.config import RLTerms

    assert RLSettings().kl_clamp == 10.0 and RLTerms().kl_clamp == 10.0
    assert RLSettings.model_validate({"klClamp": None}).kl_clamp is None
    on = torch.ones(1, 2, dtype=torch.bool)
    logp = torch.tensor([[-7.0, -1.0]], dtype=F64, requires_grad=True)
    ref = torch.tensor([[-1.0, -0.5]], dtype=F64)  # d = 6, 0.5
    kl = kl_to_reference(logp, ref, on, clamp=10.0)
    assert kl[0, 0].item() == 10.0
    assert kl[0, 1].item() == pytest.approx(math.exp(0.5) - 1.5, rel=1e-12)
    kl.sum().backward()
    assert logp.grad[0, 0].item() == 0.0
    assert logp.grad[0, 1].item() == pytest.approx(1 - math.exp(0.5), rel=1e-12)
    raw = kl_to_reference(logp.detach(), ref, on)
    assert raw[0, 0].item() == pytest.approx(math.exp(6) - 7, rel=1e-12)
    # Through the loss: the stage's clamp reaches the penalty.
    mask = torch.ones(1, 2, dtype=F64)
    x = logp.detach().clone().requires_grad_(True)
    loss, _ = policy_loss(x, x.detach(), mask, torch.zeros(1, dtype=F64), MaskedLoss(), kl_coef=1.0,
                          kl_clamp=10.0, logp_ref=ref)
    assert loss.item() == pytest.approx((10.0 + math.exp(0.5) - 1.5) / 2, rel=1e-12)


def test_spec_pairs_the_coefficient_with_a_served_reference() -> None:
    from pydantic import ValidationError

    from kiln.api.distillation import teacher_refs
    from kiln.api.spec import RLJob, RLSettings
    from kiln.operator.config import OperatorConfig

    with pytest.raises(ValidationError, match="klCoef and reference go together"):
        RLSettings.model_validate({"klCoef": 0.1})
    with pytest.raises(ValidationError, match="klCoef and reference go together"):
        RLSettings.model_validate({"reference": "sft"})
    with pytest.raises(ValidationError, match="applies to advantage 'group' only"):
        RLSettings.model_validate({"klCoef": 0.1, "reference": "sft", "advantage": "opd", "teacher": "t"})

    def job(first: str):
        stages = [{"name": "sft", "type": "sft", "tasks": ["c"]},
                  {"name": "rl", "type": "rl", "tasks": ["c"], "rl": {"klCoef": 0.1, "reference": "sft"}}]
        return RLJob.model_validate({
            "apiVersion": "kiln.dev/v1alpha1", "kind": "RLJob", "metadata": {"name": "kl"},
            "spec": {"model": {"path": "m"}, "tasks": [{"name": "c", "env": "chain", "generate": {"count": 2}}],
                     "stages": stages if first == "sft" else stages[::-1]}})
    spec = job("sft").spec
    assert teacher_refs(spec) == ["sft"]
    # The operator serves it (`frozen.py`); what is left to refuse is the sandboxes.
    assert OperatorConfig(allow_privileged_sandboxes=True).refusals(spec) == []
    with pytest.raises(ValidationError, match="rl.reference 'sft' names a stage that does not come before"):
        job("rl")
