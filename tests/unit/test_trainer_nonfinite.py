"""Poisoned updates are never applied: a step whose loss or gradient is NaN or inf is skipped
(no optimizer update, weights and AdamW state unchanged) and counted
(`kiln_trainer_nonfinite_steps_total`); the next finite step trains as usual. And a
non-finite reward never reaches the trainer: `Trajectory.check` refuses it."""
from __future__ import annotations

import math

import pytest
import torch
from prometheus_client import REGISTRY

from kiln.api.loss import MaskedLoss
from kiln.models.tiny import make_tiny_checkpoint
from kiln.services.trainer.config import OptimizerConfig, TrainerConfig
from kiln.services.trainer.engine import TrainerEngine
from kiln.trajectory import Trajectory, VersionSpan

SERIES = "kiln_trainer_nonfinite_steps_total"


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> TrainerEngine:
    model = make_tiny_checkpoint(tmp_path_factory.mktemp("nonfinite") / "m", hidden_size=64,
                                 num_layers=2, intermediate_size=128, seed=0)
    return TrainerEngine(TrainerConfig(model_dir=model, micro_batch_size=2,
                                       optimizer=OptimizerConfig(lr=3e-3, grad_clip=1.0),
                                       loss=MaskedLoss(eps_low=0.2, eps_high=0.28)), resume=False)


def _batch(rewards: list[float], engine: TrainerEngine | None = None) -> list[Trajectory]:
    """One group; on-policy log-probs with `engine`, so that no token is masked."""
    out = []
    for i, r in enumerate(rewards):
        tokens = [5 + (7 * i + j) % 200 for j in range(10)]
        out.append(Trajectory(id=f"t{i}", task_id="t", group_id="g", tokens=tokens,
                              loss_mask=[0] * 3 + [1] * 7, logp_infer=[0.0] * 3 + [-5.0] * 7,
                              version_spans=[VersionSpan(3, 10, 0)], reward=r))
    if engine is not None:
        for t, lp in zip(out, engine.logprobs([t.tokens for t in out])):
            t.logp_infer = [x if m else 0.0 for x, m in zip(lp, t.loss_mask)]
    return out


def _count(reason: str) -> float:
    return REGISTRY.get_sample_value(SERIES, {"stage": "poison", "reason": reason}) or 0.0


def _weights(engine: TrainerEngine) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in engine.named_hf_tensors()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a)


def test_a_nan_loss_step_is_skipped_counted_and_never_applied(engine: TrainerEngine) -> None:
    engine.stage = "poison"
    before, state, count = _weights(engine), dict(engine.optimizer.state), _count("loss")
    m = engine.step(_batch([1.0, float("nan"), 0.0, 1.0], engine))  # a NaN reward: NaN advantages
    assert math.isnan(m.loss)
    assert _same(before, _weights(engine)) and dict(engine.optimizer.state) == state
    assert _count("loss") == count + 1
    # The next finite step trains.
    engine.step(_batch([1.0, 0.0, 0.0, 1.0], engine))
    assert not _same(before, _weights(engine))


def test_a_nan_gradient_with_a_finite_loss_is_skipped_and_counted(engine: TrainerEngine) -> None:
    engine.stage = "poison"
    param = next(p for p in engine.model.parameters() if p.requires_grad)
    hook = param.register_hook(lambda g: g * float("inf"))
    try:
        before, count = _weights(engine), _count("grad")
        m = engine.step(_batch([1.0, 0.0, 0.0, 1.0], engine))
    finally:
        hook.remove()
    assert math.isfinite(m.loss) and not math.isfinite(m.grad_norm)
    assert _same(before, _weights(engine)) and _count("grad") == count + 1
    assert all(p.grad is None for p in engine.model.parameters())  # dropped, not kept for later


@pytest.mark.parametrize("field,value", [("reward", float("nan")), ("reward", float("inf")),
                                         ("reward", -float("inf")), ("reward_parts", {"x": float("nan")})])
def test_trajectory_check_refuses_non_finite_rewards(field: str, value) -> None:
    (t,) = _batch([1.0])
    t.check()
    setattr(t, field, value)
    with pytest.raises(ValueError, match="reward"):
        t.check()
