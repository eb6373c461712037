"""Qwen2-MoE in the Megatron model: it computes what transformers computes, its weights round-trip,
routing replay forces the recorded experts (checked against transformers forced to the same
experts), and the trainer replays a trajectory's routing, counts flips and still trains the gate."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kiln.models import moe, parallel
from kiln.models.hf_io import iter_hf_tensors, load_hf_checkpoint, read_hf_state_dict
from kiln.models.megatron_model import ArchSpec, forward_logits
from kiln.models.tiny import make_tiny_checkpoint
from kiln.routing import RoutedExperts
from kiln.services.trainer.config import OptimizerConfig, TrainerConfig
from kiln.services.trainer.engine import TrainerEngine
from kiln.trajectory import Trajectory, VersionSpan

from helpers.moe import TINY_MOE


@pytest.fixture(scope="module", autouse=True)
def _pg() -> None:
    parallel.init_parallel(1)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("moe") / "m", seed=5, **TINY_MOE)


@pytest.fixture(scope="module")
def loaded(moe_dir: Path):
    model, spec = load_hf_checkpoint(moe_dir)
    model.eval()
    return model, spec


def _tokens(b: int, s: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(4, 300, (b, s), generator=torch.Generator().manual_seed(seed))


def _hf(moe_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(moe_dir), dtype=torch.float32).eval()


def test_spec_reads_the_moe_config_and_refuses_what_is_not_built(moe_dir: Path) -> None:
    cfg = json.loads((moe_dir / "config.json").read_text())
    spec = ArchSpec.from_hf_config(cfg)
    assert spec.arch == "qwen2_moe" and spec.qkv_bias
    assert not ArchSpec.from_hf_config({**cfg, "qkv_bias": False}).qkv_bias
    assert spec.moe == moe.MoESpec(num_experts=8, topk=2, ffn_hidden_size=32, shared_ffn_hidden_size=64,
                                   norm_topk_prob=False)
    with pytest.raises(ValueError, match="decoder_sparse_step"):
        ArchSpec.from_hf_config({**cfg, "decoder_sparse_step": 2})
    with pytest.raises(ValueError, match="mlp_only_layers"):
        ArchSpec.from_hf_config({**cfg, "mlp_only_layers": [0]})
    with pytest.raises(ValueError, match="tensor_parallel=2: MoE"):
        spec.check_tp(2)


def test_logits_match_transformers_and_weights_round_trip(moe_dir: Path, loaded) -> None:
    model, spec = loaded
    toks = _tokens(2, 24)
    with torch.no_grad():
        ours = forward_logits(model, toks)
        theirs = _hf(moe_dir)(toks).logits
    assert (ours - theirs).abs().max().item() < 1e-5
    hf = read_hf_state_dict(moe_dir)
    out = dict(iter_hf_tensors(model, spec))
    assert set(out) == set(hf)
    assert all(torch.equal(out[k], hf[k]) for k in hf)


def test_replaying_the_recorded_routing_changes_nothing(loaded) -> None:
    model, _ = loaded
    toks = _tokens(3, 17, seed=1)
    with torch.no_grad(), moe.record_routing(model) as rec:
        own = forward_logits(model, toks)
    routing = moe.recorded_to_BSLK(rec, 3, 17)
    assert routing.shape == (3, 17, 2, 2)
    with torch.no_grad(), moe.replay_routing(model, routing) as flips:
        replayed = forward_logits(model, toks)
    assert torch.equal(own, replayed)
    assert (flips.flips, flips.compared) == (0, 3 * 17 * 2)


def _least_likely(model, toks: torch.Tensor) -> torch.Tensor:
    """For every position and layer, the two experts the router scores LOWEST under its own
    routing: a routing the trainer would never choose."""
    picked = []

    class Spy(moe.RouterTap):
        def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
            picked.append(torch.sort(scores, dim=1, stable=True).indices[:, :topk])
            return default_compute_topk(scores, topk, num_groups, group_topk)

    taps = moe.router_taps(model)
    routers = [m for m in model.modules() if getattr(m, "router_replay", None) in taps]
    for r in routers:
        r.router_replay = Spy()
    try:
        with torch.no_grad():
            forward_logits(model, toks)
    finally:
        for r, t in zip(routers, taps):
            r.router_replay = t
    b, s = toks.shape
    return moe.recorded_to_BSLK(picked, b, s)


def test_replay_forces_experts_the_router_would_not_choose(moe_dir: Path, loaded) -> None:
    """The hand-made case: replay the least-likely experts. Megatron with replay must equal
    transformers' Qwen2-MoE with its top-k replaced by the same experts (an independent forward),
    differ from the model's own output, and count every compared pair as a flip."""
    model, _ = loaded
    toks = _tokens(2, 12, seed=2)
    forced = _least_likely(model, toks)
    with torch.no_grad(), moe.replay_routing(model, forced) as flips:
        ours = forward_logits(model, toks)
    with torch.no_grad():
        own = forward_logits(model, toks)
    assert flips.flips == flips.compared == 2 * 12 * 2

    hf = _hf(moe_dir)
    layer_of = {}
    for i, layer in enumerate(hf.model.layers):
        layer_of[id(layer.mlp.gate)] = i

        def forced_forward(hidden, gate=layer.mlp.gate, i=i):
            hidden = hidden.reshape(-1, gate.hidden_dim)
            logits = F.linear(hidden, gate.weight)
            probs = torch.softmax(logits, dtype=torch.float, dim=-1)
            # HF's token order is [B, S] flattened.
            idx = forced[:, :, i].reshape(-1, 2)
            return logits, probs.gather(1, idx).to(logits.dtype), idx

        layer.mlp.gate.forward = forced_forward
    with torch.no_grad():
        theirs = hf(toks).logits
    assert (ours - theirs).abs().max().item() < 1e-5
    assert (ours - own).abs().max().item() > 1e-3


def test_partial_routing_keeps_the_routers_choice_where_nothing_was_recorded(loaded) -> None:
    model, _ = loaded
    toks = _tokens(1, 10, seed=3)
    forced = _least_likely(model, toks)
    valid = torch.zeros(1, 10, dtype=torch.bool)
    valid[0, 6:] = True
    with torch.no_grad():
        own = forward_logits(model, toks)
        with moe.replay_routing(model, forced, valid) as flips:
            partial = forward_logits(model, toks)
    # Causal: positions before the first replayed one are the model's own (up to rounding: an
    # expert's matmul runs over however many tokens were routed to it).
    assert (partial[0, :6] - own[0, :6]).abs().max() < 1e-6
    assert (partial[0, 6:] - own[0, 6:]).abs().max() > 1e-3
    assert (flips.flips, flips.compared) == (4 * 2, 4 * 2)


def _trajectories(model, n: int, s: int, routing: torch.Tensor | None) -> list[Trajectory]:
    toks = _tokens(n, s, seed=4)
    out = []
    for i in range(n):
        routed = (RoutedExperts.pack(routing[i, : s - 1].numpy(), 8) if routing is not None else None)
        out.append(Trajectory(
            id=f"t{i}", task_id="x", group_id="g", tokens=toks[i].tolist(),
            loss_mask=[0] * 4 + [1] * (s - 4), logp_infer=[0.0] * s,
            version_spans=[VersionSpan(4, s, 0)], prompt_len=4, reward=1.0 if i % 2 else -1.0,
            routed_experts=routed))
    return out


@pytest.mark.parametrize("mode", ["replay", "record", "off"])
def test_trainer_replays_counts_flips_and_trains_the_gate(moe_dir: Path, tmp_path: Path, mode: str) -> None:
    trainer = TrainerEngine(TrainerConfig(
        model_dir=moe_dir, micro_batch_size=2, optimizer=OptimizerConfig(lr=1e-2, grad_clip=0.0),
        checkpoint_dir=tmp_path / "ck", routing_replay=mode), resume=False)
    toks = _tokens(4, 14, seed=4)
    forced = _least_likely(trainer.model, toks)
    trajs = _trajectories(trainer.model, 4, 14, forced)
    seqs = [t.tokens for t in trajs]
    replayed, flips = trainer.logprobs_routed(seqs, [t.routed_experts for t in trajs], replay=True)
    compared, flips2 = trainer.logprobs_routed(seqs, [t.routed_experts for t in trajs], replay=False)
    assert compared == trainer.logprobs(seqs)
    assert flips.flips == flips.compared == flips2.flips == 4 * 13 * 2
    assert max(abs(a - b) for r, c in zip(replayed, compared) for a, b in zip(r, c)) > 1e-3

    # The rollout's log-probs are those of the replayed routing (the rollout chose it).
    for t, lp in zip(trajs, replayed):
        t.logp_infer = [0.0] * 4 + lp[4:]
    gate = dict(trainer.model.named_parameters())["decoder.layers.0.mlp.router.weight"]
    before = gate.detach().clone()
    m = trainer.step(trajs)
    assert not torch.equal(before, gate.detach()), "the router's gate must be trained"
    if mode == "off":
        assert m.routing_flip_frac is None
    else:
        # Every trained position's recorded routing differs from the trainer's own.
        assert m.routing_flip_frac == 1.0
    # The mismatch metric tells which log-probs the loss saw: with replay, the rollout's.
    if mode == "replay":
        assert m.mismatch_abs < 1e-6
    else:
        assert m.mismatch_abs > 1e-3


def test_tokens_whose_routing_is_a_newer_versions_are_left_out_and_counted(moe_dir: Path, tmp_path: Path) -> None:
    """A generation that straddled a weight update: tokens 4..7 sampled under v0, 8..13 under
    v1, and the routing of every row recorded under v1 (the engine recomputed the context).
    With replay, the step trains only tokens 8..13 and reports 4 of 10 trained tokens taken out;
    with the routing recorded under v0 for rows 0..6 (a prefix cache), nothing is."""
    import dataclasses

    trainer = TrainerEngine(TrainerConfig(
        model_dir=moe_dir, micro_batch_size=2, optimizer=OptimizerConfig(lr=1e-2, grad_clip=0.0),
        checkpoint_dir=tmp_path / "ck", routing_replay="replay"), resume=False)
    toks = _tokens(2, 14, seed=4)
    trajs = _trajectories(trainer.model, 2, 14, _least_likely(trainer.model, toks))
    for t in trajs:
        t.version_spans = [VersionSpan(4, 8, 0), VersionSpan(8, 14, 1)]
        t.routed_experts = dataclasses.replace(t.routed_experts, versions=((0, 1),))
    m = trainer.step(trajs)
    assert m.routing_straddle_frac == pytest.approx(0.4) and m.tokens == 2 * 6
    for t in trajs:
        t.routed_experts = dataclasses.replace(t.routed_experts, versions=((0, 0), (7, 1)))
    m = trainer.step(trajs)
    assert m.routing_straddle_frac == 0.0 and m.tokens == 2 * 10


def test_batch_refuses_routing_of_different_models() -> None:
    from kiln.services.trainer.batch import collate

    a = Trajectory(id="a", task_id="x", group_id="g", tokens=[1, 2, 3], loss_mask=[0, 1, 1],
                   logp_infer=[0, -1, -1], version_spans=[VersionSpan(1, 3, 0)],
                   routed_experts=RoutedExperts.pack(np.zeros((2, 2, 2), dtype=int), 8))
    b = Trajectory(**{**a.__dict__, "id": "b",
                      "routed_experts": RoutedExperts.pack(np.zeros((2, 3, 2), dtype=int), 8)})
    with pytest.raises(ValueError, match="different shapes"):
        collate([a, b])
