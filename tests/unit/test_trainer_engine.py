"""The trainer engine on a tiny model: learning, masking, version/moment reset, checkpoints."""
from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import pytest
import torch
from prometheus_client import REGISTRY

from kiln.api.loss import MaskedLoss, PPOLoss
from kiln.models.tiny import make_tiny_checkpoint
from kiln.services.trainer.checkpoint import list_checkpoints
from kiln.services.trainer.config import OptimizerConfig, RLTerms, TrainerConfig
from kiln.services.trainer.engine import TrainerEngine
from kiln.trajectory import Trajectory, VersionSpan


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(
        tmp_path_factory.mktemp("engine") / "m", hidden_size=64, num_layers=2, intermediate_size=128, seed=0
    )


def _config(model_dir: Path, **kw) -> TrainerConfig:
    base = dict(
        model_dir=model_dir,
        micro_batch_size=2,
        optimizer=OptimizerConfig(lr=3e-3, grad_clip=1.0),
        loss=MaskedLoss(eps_low=0.2, eps_high=0.28),
    )
    base.update(kw)
    return TrainerConfig(**base)


def _trajectories(engine: TrainerEngine | None, n: int = 4, seed: int = 0, prompt: int = 3) -> list[Trajectory]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        length = rng.randint(8, 14)
        tokens = [rng.randrange(4, 300) for _ in range(length)]
        mask = [0] * prompt + [1] * (length - prompt)
        out.append(
            Trajectory(
                id=f"t{i}", task_id="task", group_id="g", tokens=tokens, loss_mask=mask,
                logp_infer=[0.0] * length, version_spans=[VersionSpan(prompt, length, 0)],
                reward=1.0 if i % 2 == 0 else -1.0,  # one group of mean 0: advantages +-1
            )
        )
    if engine is not None:  # on-policy: the inference log-probs are the current ones
        for t, lp in zip(out, engine.logprobs([t.tokens for t in out])):
            t.logp_infer = [x if m else 0.0 for x, m in zip(lp, t.loss_mask)]
    return out


def _mean_logp(engine: TrainerEngine, trajs: list[Trajectory]) -> list[float]:
    out = []
    for t, lp in zip(trajs, engine.logprobs([t.tokens for t in trajs])):
        vals = [x for x, m in zip(lp, t.loss_mask) if m]
        out.append(sum(vals) / len(vals))
    return out


def test_sft_steps_reduce_loss(model_dir: Path) -> None:
    engine = TrainerEngine(_config(model_dir))
    batch = _trajectories(None, n=4)
    losses = [engine.sft_step(batch).loss for _ in range(6)]
    assert losses[-1] < losses[0] - 0.5, losses
    assert engine.step_count == 6


def test_rl_steps_follow_the_advantage(model_dir: Path) -> None:
    engine = TrainerEngine(_config(model_dir, loss=MaskedLoss(eps_low=0.9, eps_high=10.0)))
    batch = _trajectories(engine, n=4)
    before = _mean_logp(engine, batch)
    first = engine.step(batch)
    for _ in range(3):
        last = engine.step(batch)
    after = _mean_logp(engine, batch)
    # Positive advantage (even ids) pushes log-probs up, negative pulls them down.
    assert after[0] > before[0] and after[2] > before[2]
    assert after[1] < before[1] and after[3] < before[3]
    assert last.loss < first.loss
    # On-policy first step: no mismatch, nothing masked, ratio 1.
    assert first.ratio_mask_frac == 0.0 and first.mismatch_abs < 1e-5 and first.kept_frac == 1.0
    assert first.ratio_mean == pytest.approx(1.0, abs=1e-5)
    assert first.tokens == sum(sum(t.loss_mask) for t in batch)


@pytest.mark.parametrize("mode", ["masked", "ppo"])
def test_off_policy_tokens_are_masked_and_reported(model_dir: Path, mode: str) -> None:
    engine = TrainerEngine(_config(model_dir, loss=MaskedLoss() if mode == "masked" else PPOLoss(mode="ppo", icepop_beta=2.0)))
    engine.stage = "reasoning"
    batch = _trajectories(engine, n=2)
    # The inference engine claims much higher probabilities than the trainer computes: every
    # ratio to pi_infer is ~e^-3, outside [0.8, 1.28], and rho is outside [1/2, 2]. masked
    # mode's ratio mask takes every token; ppo's ratio (to the trainer's own weights) is 1,
    # and IcePop takes every token.
    for t in batch:
        t.logp_infer = [x + 3.0 if m else 0.0 for x, m in zip(t.logp_infer, t.loss_mask)]
    before = [p.detach().clone() for p in engine.model.parameters()]
    tokens_before = REGISTRY.get_sample_value("kiln_train_tokens_total") or 0.0
    m = engine.step(batch)
    ratio, ice = (1.0, 0.0) if mode == "masked" else (0.0, 1.0)
    assert (m.ratio_mask_frac, m.icepop_mask_frac, m.kept_frac) == (ratio, ice, 0.0)
    assert (m.ratio_only_frac, m.icepop_only_frac, m.both_masked_frac) == (ratio, ice, 0.0)
    assert m.grad_norm == 0.0
    assert m.mismatch_abs == pytest.approx(3.0, abs=1e-4)
    assert m.mismatch_kl == pytest.approx(torch.expm1(torch.tensor(-3.0)).item() + 3.0, abs=1e-3)
    assert all(torch.equal(a, b) for a, b in zip(before, engine.model.parameters()))
    assert REGISTRY.get_sample_value("kiln_ratio_mask_fraction") == ratio
    assert REGISTRY.get_sample_value("kiln_icepop_mask_fraction") == ice
    assert REGISTRY.get_sample_value("kiln_logprob_mismatch_abs_mean") == pytest.approx(3.0, abs=1e-4)
    assert REGISTRY.get_sample_value("kiln_logprob_mismatch_kl") == pytest.approx(m.mismatch_kl)
    assert REGISTRY.get_sample_value("kiln_train_step", {"stage": "reasoning"}) == 1.0
    assert REGISTRY.get_sample_value("kiln_train_loss", {"stage": "reasoning"}) == m.loss
    assert REGISTRY.get_sample_value("kiln_train_tokens_total") - tokens_before == m.tokens
    assert REGISTRY.get_sample_value("kiln_trainer_tokens_per_second") == m.tokens_per_second > 0


def test_new_version_resets_moments(model_dir: Path) -> None:
    engine = TrainerEngine(_config(model_dir))
    engine.sft_step(_trajectories(None, n=2))
    states = list(engine.optimizer.state.values())
    assert states and any(s["exp_avg"].abs().sum() > 0 for s in states)
    assert engine.new_version() == 1
    for s in engine.optimizer.state.values():
        assert torch.count_nonzero(s["exp_avg"]) == 0 and torch.count_nonzero(s["exp_avg_sq"]) == 0
        assert s["step"].item() == 0
    assert REGISTRY.get_sample_value("kiln_policy_version", {"component": "trainer"}) == 1.0
    keep = TrainerEngine(_config(model_dir, optimizer=OptimizerConfig(lr=3e-3, reset_moments_on_publish=False)))
    keep.sft_step(_trajectories(None, n=2))
    keep.new_version()
    assert any(s["exp_avg"].abs().sum() > 0 for s in keep.optimizer.state.values())


def test_checkpoint_resume_gives_identical_next_step(model_dir: Path, tmp_path: Path) -> None:
    cfg = _config(
        model_dir, checkpoint_dir=tmp_path / "ckpt", checkpoint_interval=2, keep_checkpoints=2,
        optimizer=OptimizerConfig(lr=3e-3, warmup_steps=5),
        loss=MaskedLoss(eps_low=0.9, eps_high=10.0),
    )
    a = TrainerEngine(cfg)
    batch = _trajectories(a, n=4, seed=1)
    a.step(batch)
    a.new_version()
    a.step(batch)  # step 2: checkpoint by interval
    assert [p.name for p in list_checkpoints(tmp_path / "ckpt")] == ["step_00000002"]
    # A half-written checkpoint is ignored on resume.
    (tmp_path / "ckpt" / ".tmp-step_00000003").mkdir()
    expected = a.step(batch)
    b = TrainerEngine(cfg)
    assert b.resumed_from == tmp_path / "ckpt" / "step_00000002"
    assert (b.step_count, b.policy_version) == (2, 1)
    got = b.step(batch)
    assert expected.grad_norm > 0 and expected.kept_frac == 1.0
    for key in ("loss", "grad_norm", "kept_frac", "mismatch_abs", "lr"):
        assert getattr(got, key) == getattr(expected, key), key
    assert all(torch.equal(x, y) for x, y in zip(a.model.parameters(), b.model.parameters()))
    a.step(batch)  # step 4 checkpoints; only the two newest stay
    assert [p.name for p in list_checkpoints(tmp_path / "ckpt")] == ["step_00000002", "step_00000004"]


def test_a_checkpoint_knows_whether_its_weights_are_their_versions(model_dir: Path, tmp_path: Path) -> None:
    # An SFT stage publishes at its end only: a checkpoint taken before that holds trained
    # weights under version 0, which rollout serves as the initial ones. Resumed, the trainer
    # must publish them anew (src/kiln/services/trainer/main.py), so it has to know.
    cfg = _config(model_dir, checkpoint_dir=tmp_path / "ckpt", checkpoint_interval=2)
    a = TrainerEngine(cfg)
    assert not a.unpublished
    batch = _trajectories(None, n=2)
    a.sft_step(batch)
    a.sft_step(batch)  # step 2: checkpoint by interval, nothing published yet
    b = TrainerEngine(cfg)
    assert (b.step_count, b.policy_version, b.unpublished) == (2, 0, True)
    b.new_version()
    b.save_checkpoint()
    c = TrainerEngine(cfg)
    assert (c.step_count, c.policy_version, c.unpublished) == (2, 1, False)


def test_two_updates_per_step_use_start_of_step_logprobs(model_dir: Path) -> None:
    # ppo mode: the ratio is to the weights at the start of the step.
    engine = TrainerEngine(_config(model_dir, minibatches_per_step=2, micro_batch_size=1,
                                   loss=PPOLoss(mode="ppo", icepop_beta=2.0)))
    batch = _trajectories(engine, n=4)
    m = engine.step(batch)
    assert next(iter(engine.optimizer.state.values()))["step"].item() == 2
    # The first half trains on-policy (ratio 1), the second half after one update: ratio != 1.
    assert m.ratio_mean != pytest.approx(1.0, abs=1e-7)
    assert m.mismatch_abs < 1e-5


def test_opd_trajectories_use_teacher_advantage(model_dir: Path) -> None:
    engine = TrainerEngine(_config(model_dir, loss=MaskedLoss(eps_low=0.9, eps_high=10.0)))
    batch = _trajectories(engine, n=2)
    for t in batch:
        t.reward = 0.0  # no task advantage
        # The teacher prefers every generated token far more than the student does.
        t.teacher_logp = [x + 2.0 for x in t.logp_infer]
    before = _mean_logp(engine, batch)
    engine.step(batch)
    after = _mean_logp(engine, batch)
    assert after[0] > before[0] and after[1] > before[1]


def test_distillation_takes_the_students_logprobs_from_the_start_of_the_step(model_dir: Path) -> None:
    """With two updates per step, the second minibatch's distillation advantage is teacher minus
    the student *before the step* (as a reward would be fixed before it): t1's teacher equals
    the student's start-of-step log-probs, so its advantage is exactly 0 and its update has no
    gradient, although the first update (t0, a teacher far above) moved the student. Taking the
    current log-probs instead would give t1 a non-zero advantage and gradient."""
    engine = TrainerEngine(_config(model_dir, minibatches_per_step=2, micro_batch_size=1,
                                   loss=MaskedLoss(eps_low=0.9, eps_high=10.0)))
    t0, t1 = _trajectories(engine, n=2)
    for t in (t0, t1):
        t.reward = 0.0  # no task advantage: distillation alone
    t0.teacher_logp = [x + 2.0 for x in t0.logp_infer]
    t1.teacher_logp = list(t1.logp_infer)
    norms: list[float] = []
    clip = engine._clip_grads
    engine._clip_grads = lambda: norms.append(clip()) or norms[-1]
    before = _mean_logp(engine, [t1])[0]
    engine.step([t0, t1])
    assert _mean_logp(engine, [t1])[0] != pytest.approx(before, abs=1e-6)  # the student moved
    assert norms[0] > 1e-3 and norms[1] == 0.0


def test_the_task_reward_weight_reaches_a_distilled_step(model_dir: Path) -> None:
    """`rl.taskRewardWeight` weighs the task advantage of sequences that carry a teacher's
    log-probs, in the engine's own step: with a teacher that agrees with the student (no
    distillation signal) and one group rewarded +1/-1, weight 0 trains nothing, and the
    gradient grows with the weight (the advantage is linear in it, the ratio 1 on-policy)."""
    norms, moved = {}, {}
    for weight in (0.0, 0.5, 1.0):
        engine = TrainerEngine(_config(model_dir, loss=MaskedLoss(eps_low=0.9, eps_high=10.0),
                                       terms=RLTerms(task_reward_weight=weight)))
        batch = _trajectories(engine, n=2)
        for t in batch:
            t.teacher_logp = list(t.logp_infer)
        before = _mean_logp(engine, batch)
        norms[weight] = engine.step(batch).grad_norm
        moved[weight] = [a - b for a, b in zip(_mean_logp(engine, batch), before)]
    assert norms[1.0] > 1e-3
    assert norms[0.0] < 1e-3 * norms[1.0]
    assert norms[0.5] == pytest.approx(0.5 * norms[1.0], rel=0.05)
    assert moved[1.0][0] > 0 > moved[1.0][1]  # rewarded +1 up, -1 down


def test_a_shaping_reward_credited_by_turn_trains_only_the_tokens_that_earned_it(model_dir: Path) -> None:
    # One group of two with equal rewards (advantage 0), of which t0 earned a shaping reward
    # of 1 on its first half of generated tokens, t1 none: credited to the whole episode
    # nothing would move; credited by turn, t0's other tokens carry -1/2 and t1's +1/2.
    engine = TrainerEngine(_config(model_dir, loss=MaskedLoss(eps_low=0.9, eps_high=10.0)))
    batch = _trajectories(engine, n=2)
    halves = []
    for t, shaping in zip(batch, (1.0, 0.0)):
        gen = [j for j, m in enumerate(t.loss_mask) if m]
        marked = set(gen[: len(gen) // 2])
        t.reward, t.shaping_reward = 0.0, shaping
        t.shaping_mask = [int(j in marked) for j in range(len(t.tokens))]
        halves.append([j for j in gen if j not in marked])
    assert engine.step([dataclasses.replace(t, shaping_mask=[]) for t in batch]).grad_norm == 0.0

    def rest(trajs):  # mean log-prob of the tokens outside each mask
        return [sum(lp[j] for j in js) / len(js)
                for lp, js in zip(engine.logprobs([t.tokens for t in trajs]), halves)]
    before = rest(batch)
    assert engine.step(batch).grad_norm > 0
    after = rest(batch)
    assert after[0] < before[0] and after[1] > before[1]


def test_bad_inputs_are_rejected(model_dir: Path) -> None:
    engine = TrainerEngine(_config(model_dir))
    batch = _trajectories(None, n=1)
    batch[0].tokens[-1] = 10_000
    with pytest.raises(ValueError, match="token ids"):
        engine.sft_step(batch)
    batch = _trajectories(None, n=1)
    batch[0].loss_mask = [0] * len(batch[0].tokens)
    batch[0].version_spans = []
    with pytest.raises(ValueError, match="no trainable tokens"):
        engine.sft_step(batch)
    with pytest.raises(ValueError, match="checkpoint_dir"):
        engine.save_checkpoint()


class _RunsCode:
    """What a tampered checkpoint could hold: unpickling it would run code."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_a_checkpoint_holding_pickled_objects_is_refused_unrun(tmp_path: Path) -> None:
    from kiln.services.trainer.checkpoint import read_checkpoint

    ckpt, marker = tmp_path / "step_00000001", tmp_path / "ran"
    ckpt.mkdir()
    (ckpt / "meta.json").write_text('{"step": 1, "tensor_parallel": 1}')
    torch.save({"model": {"w": torch.zeros(2)}, "extra": _RunsCode(marker)}, ckpt / "rank_00.pt")
    with pytest.raises(ValueError, match="rank_00.pt: holds more than tensors and plain values"):
        read_checkpoint(ckpt)
    assert not marker.exists()
    torch.save({"model": {"w": torch.zeros(2)}, "step": 1}, ckpt / "rank_00.pt")
    assert read_checkpoint(ckpt)[1]["step"] == 1
