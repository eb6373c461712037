"""Packed sequences in the trainer (`trainer.maxTokensPerMicroBatch`, `kiln.models.packing`): the
packed forward gives the padded one's log-probs, and the loss and its gradients equal the padded
path's for every loss mode and aggregation, with routing replay, a teacher's top k and tool
choices carried through; micro-batches by a token budget, replicas balanced by tokens.

Tolerance: float32 with different matrix shapes sums in a different order, so log-probs agree
to 2e-5 and gradients to 1e-4 of the largest gradient entry (measured here: about 1e-6)."""
from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from kiln.api.loss import MaskedLoss, PPOLoss
from kiln.models import packing, parallel
from kiln.models.hf_io import load_hf_checkpoint
from kiln.models.megatron_model import ToolChoices
from kiln.models.tiny import make_tiny_checkpoint
from kiln.routing import RoutedExperts
from kiln.services.trainer.batch import collate
from kiln.services.trainer.config import OptimizerConfig, TrainerConfig
from kiln.services.trainer import microbatches
from kiln.services.trainer.engine import TrainerEngine
from kiln.services.trainer.loss import loss_normalizer, policy_loss
from kiln.services.trainer.replay import batch_logprobs, packed_batch_logprobs
from kiln.trajectory import Trajectory, VersionSpan

from helpers.moe import TINY_MOE


@pytest.fixture(scope="module", autouse=True)
def _pg() -> None:
    parallel.init_parallel(1)


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("pack") / "m", hidden_size=64, num_layers=2,
                                intermediate_size=128, seed=0)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("pack-moe") / "m", seed=5, **TINY_MOE)


def _trajectories(lengths: list[int], seed: int = 0, *, teacher: bool = False, topk: int = 0,
                  experts: int = 0) -> list[Trajectory]:
    rng = random.Random(seed)
    out = []
    for i, n in enumerate(lengths):
        prompt = rng.randint(1, max(1, n // 3))
        t = Trajectory(
            id=f"t{i}", task_id="x", group_id=f"g{i % 3}", tokens=[rng.randrange(4, 300) for _ in range(n)],
            loss_mask=[0] * prompt + [1] * (n - prompt),
            logp_infer=[0.0] * prompt + [-rng.uniform(0.5, 4.0) for _ in range(n - prompt)],
            version_spans=[VersionSpan(prompt, n, 0)], reward=float(rng.random() < 0.5), prompt_len=prompt)
        if teacher and i % 2 == 0:
            t.teacher_logp = [0.0] * prompt + [-rng.uniform(0.5, 4.0) for _ in range(n - prompt)]
        if topk:
            t.teacher_top_k = topk
            t.teacher_topk_ids = [rng.randrange(4, 300) for _ in range(n * topk)]
            t.teacher_topk_logp = [-rng.uniform(0.1, 5.0) for _ in range(n * topk)]
        if experts:
            ids = [[rng.sample(range(experts), 2) for _ in range(2)] for _ in range(n - 1)]
            t.routed_experts = RoutedExperts.pack(ids, experts)
        t.check()
        out.append(t)
    return out


def _close_where_valid(a: torch.Tensor, b: torch.Tensor, lengths: list[int], tol: float) -> None:
    for i, n in enumerate(lengths):
        assert (a[i, :n] - b[i, :n]).abs().max().item() < tol, f"row {i}"


@pytest.mark.parametrize("attention", ["sdpa", "megatron"])
def test_loss_and_gradients_equal_the_padded_path(dense_dir: Path, attention: str) -> None:
    model, _ = load_hf_checkpoint(dense_dir, attention=attention)
    lengths = [8, 150, 23, 300, 61, 9, 120]
    tb = collate(_trajectories(lengths), advantages=[1.0, -1.0, 0.5, -0.5, 2.0, 0.0, -2.0])
    params = [p for p in model.parameters() if p.requires_grad]
    cases = [(cfg, agg) for cfg in (MaskedLoss(eps_low=0.9, eps_high=50.0), PPOLoss(mode="ppo", icepop_beta=50.0))
             for agg in ("token-mean", "sequence-mean", "sequence-sum")]
    for cfg, agg in cases:
        cfg = cfg.model_copy(update={"aggregation": agg})
        grads, losses = [], []
        for fn in (batch_logprobs, packed_batch_logprobs):
            logp, _, _ = fn(model, tb, "off")
            norm = loss_normalizer(tb.loss_mask, agg, 512)
            loss, _ = policy_loss(logp, tb.logp_infer, tb.loss_mask, tb.advantages, cfg,
                                  logp_train_old=logp.detach() + 0.01, normalizer=norm)
            losses.append(loss.item())
            grads.append(torch.autograd.grad(loss, params))
        assert losses[1] == pytest.approx(losses[0], rel=1e-5, abs=1e-6), (cfg.mode, agg)
        scale = max(g.abs().max().item() for g in grads[0])
        assert scale > 0
        worst = max((a - b).abs().max().item() for a, b in zip(*grads))
        assert worst <= 1e-4 * scale, (cfg.mode, agg, worst, scale)


def test_attention_stays_within_each_packed_sequence(dense_dir: Path) -> None:
    """Each sequence scores the same packed after others as it does padded: a packed row leaks
    nothing across its boundaries. Break it on purpose (attention over the whole row, causal
    only) and the later sequences' log-probs move by far more than rounding. (RoPE is relative,
    so restarting positions changes nothing mathematically once attention stays within a
    sequence; it keeps the angles, and so their float32 rounding, those of the padded path.)"""
    from kiln.models.megatron_model import token_logprobs

    model, _ = load_hf_checkpoint(dense_dir)
    lengths = [40, 17, 33]
    tb = collate(_trajectories(lengths, seed=3))
    padded, _, _ = batch_logprobs(model, tb, "off")
    packed_lp, _, _ = packed_batch_logprobs(model, tb, "off")
    _close_where_valid(padded, packed_lp, lengths, 2e-5)
    assert (packed_lp[:, 0] == 0).all()
    flat = torch.cat([tb.tokens[i, :n] for i, n in enumerate(lengths)])[None]
    with packing.packed(model, lengths):
        leak = packing._SEGMENTS.set(None)  # the attention no longer sees the boundaries
        try:
            leaky = token_logprobs(model, flat)
        finally:
            packing._SEGMENTS.reset(leak)
    second = leaky[0, lengths[0] + 1: lengths[0] + lengths[1]]
    assert (second - padded[1, 1:lengths[1]]).abs().max().item() > 1e-3


def test_tool_choices_score_the_same_in_a_one_row_batch(dense_dir: Path) -> None:
    """With one row, the cross entropy's in-place work on the logits must not reach the rows
    the tool choices are scored from: the same choice scores alike alone and beside another."""
    model, _ = load_hf_checkpoint(dense_dir)
    tb = collate(_trajectories([30, 24], seed=4))
    ids = tb.tokens[0, 10].repeat(3) + torch.tensor([0, 1, 2])
    tb.choices = ToolChoices(torch.tensor([0]), torch.tensor([10]), ids[None], torch.tensor([4.0]))
    two, _, _ = batch_logprobs(model, tb, "off")
    one, _, _ = batch_logprobs(model, tb.select(torch.tensor([0])), "off")
    assert abs(one[0, 10].item() - two[0, 10].item()) < 2e-5
    assert abs(two[0, 10].item()) < 2.0  # among 3 choices, not the whole vocabulary


def test_routing_replay_teacher_top_k_and_tool_choices_are_carried(moe_dir: Path) -> None:
    model, _ = load_hf_checkpoint(moe_dir)
    lengths = [12, 40, 7, 25]
    trajs = _trajectories(lengths, seed=1, teacher=True, topk=3, experts=8)
    tb = collate(trajs)
    # Two tokens drawn as tool choices (row 1 position 20, row 3 position 9).
    tb.choices = ToolChoices(torch.tensor([1, 3]), torch.tensor([20, 9]),
                             torch.stack([tb.tokens[1, 20].repeat(3) + torch.tensor([0, 1, 2]),
                                          tb.tokens[3, 9].repeat(3) + torch.tensor([0, 5, 7])]),
                             torch.tensor([4.0, 2.0]))
    for mode in ("replay", "record"):
        a, fa, ta = batch_logprobs(model, tb, mode, topk=True)
        b, fb, tbk = packed_batch_logprobs(model, tb, mode, topk=True)
        _close_where_valid(a, b, lengths, 2e-5)
        for i, n in enumerate(lengths):
            assert (ta[i, :n] - tbk[i, :n]).abs().max().item() < 2e-5
        assert (fa.flips, fa.compared) == (fb.flips, fb.compared)
        assert fa.compared == sum(2 * (n - 1) for n in lengths)
    # The tool choices changed those tokens' log-probs (and both paths agree on them).
    plain = collate(trajs)
    c, _, _ = batch_logprobs(model, plain, "replay")
    assert abs(c[1, 20].item() - a[1, 20].item()) > 1e-4


def test_plans_fit_the_budget_and_replicas_share_tokens() -> None:
    lengths = [500, 20, 300, 300, 90, 1200, 10, 64]
    groups = packing.plan(lengths, 600)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for g in groups:
        assert sum(lengths[i] for i in g) <= 600 or len(g) == 1
    assert [5] in groups  # longer than the budget: alone
    assert len(groups) == 4  # 1200 | 500+90 | 300+300 | 64+20+10
    shares = packing.balance(lengths, 2)
    loads = [sum(lengths[i] for i in s) for s in shares]
    assert sorted(i for s in shares for i in s) == list(range(len(lengths)))
    assert abs(loads[0] - loads[1]) <= max(lengths)  # by tokens, not by count
    assert loads == [1200 + 10 + 20, 500 + 300 + 300 + 90 + 64][::1] or abs(loads[0] - loads[1]) < 300


def test_the_engine_trains_the_same_step_packed(dense_dir: Path, monkeypatch) -> None:
    """Two engines from one checkpoint, one padding micro-batches of 2, one packing up to 256
    tokens: the same step's loss and gradient norm, and fewer forward passes for the packed one."""
    lengths = [9, 140, 30, 12, 90, 200, 17, 44]
    out = {}
    for budget in (None, 256):
        engine = TrainerEngine(TrainerConfig(model_dir=dense_dir, micro_batch_size=2,
                                             max_tokens_per_micro_batch=budget,
                                             optimizer=OptimizerConfig(lr=1e-3), loss=MaskedLoss()),
                               resume=False)
        trajs = _trajectories(lengths, seed=2)
        for t, lp in zip(trajs, engine.logprobs([t.tokens for t in trajs])):
            t.logp_infer = [x if m else 0.0 for x, m in zip(lp, t.loss_mask)]
        calls = []
        forward = microbatches.logprobs
        monkeypatch.setattr(microbatches, "logprobs",
                            lambda model, mb, *a, **kw: calls.append(len(mb.lengths)) or forward(model, mb, *a, **kw))
        m = engine.step(trajs)
        monkeypatch.undo()
        out[budget] = (m.loss, m.grad_norm, len(calls))
    assert out[256][0] == pytest.approx(out[None][0], rel=1e-5, abs=1e-7)
    assert out[256][1] == pytest.approx(out[None][1], rel=1e-4)
    assert (out[None][2], out[256][2]) == (4, 3)


def test_dsa_models_are_refused() -> None:
    class Dsa(torch.nn.Module):
        kiln_attention = "dsa"  # what kiln.models.dsa marks a DSA model with

    with pytest.raises(ValueError, match="maxTokensPerMicroBatch"):
        with packing.packed(Dsa(), [3]):
            pass


@pytest.mark.slow
def test_long_tailed_lengths_up_to_2048(dense_dir: Path) -> None:
    model, _ = load_hf_checkpoint(dense_dir)
    lengths = [8, 2048, 13, 700, 64, 1500, 31]
    tb = collate(_trajectories(lengths, seed=9), advantages=[1.0, -1.0, 0.5, -0.5, 2.0, 0.0, -2.0])
    params = [p for p in model.parameters() if p.requires_grad]
    grads = []
    for fn in (batch_logprobs, packed_batch_logprobs):
        logp, _, _ = fn(model, tb, "off")
        loss, _ = policy_loss(logp, tb.logp_infer, tb.loss_mask, tb.advantages, MaskedLoss(eps_low=0.9, eps_high=50.0))
        grads.append(torch.autograd.grad(loss, params))
    scale = max(g.abs().max().item() for g in grads[0])
    assert max((a - b).abs().max().item() for a, b in zip(*grads)) <= 1e-4 * scale
