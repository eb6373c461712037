"""Every registered model family, built by the Megatron model code from a tiny random checkpoint
made with transformers' own config class: its logits match transformers' (float32, max |diff|
< 1e-5), its weights round-trip HF -> Megatron -> HF bit for bit (and the exported directory
loads in transformers), and for the MoE families recorded routing replays with no flips."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from kiln.api.model_families import FAMILIES
from kiln.models import moe, parallel
from kiln.models.hf_io import iter_hf_tensors, load_hf_checkpoint, read_hf_state_dict, save_hf_checkpoint
from kiln.models.megatron_model import forward_logits, token_logprobs
from kiln.models.tiny import ARCHS, make_tiny_checkpoint

TOLERANCE = 1e-5
"""max |logit diff| against transformers, float32."""
# Head size 32 (64 / 2): one vLLM's CPU attention has kernels for.
TINY = dict(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128)
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
FAMILY_NAMES = [f.name for f in FAMILIES]


def tiny_kwargs(arch: str) -> dict:
    kw = dict(arch=arch, **TINY, **(MOE if arch.endswith("_moe") else {}))
    if arch == "qwen3":
        kw.update(num_heads=4, num_kv_heads=2, head_dim=32)  # heads x head_dim != hidden, as in Qwen3-8B
    return kw


@pytest.fixture(scope="module", autouse=True)
def _pg() -> None:
    parallel.init_parallel(1)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {arch: make_tiny_checkpoint(root / arch, seed=11 + i, **tiny_kwargs(arch))
            for i, arch in enumerate(FAMILY_NAMES)}


def test_every_family_has_a_tiny_checkpoint() -> None:
    assert set(FAMILY_NAMES) <= set(ARCHS)


@pytest.mark.parametrize("arch", FAMILY_NAMES)
def test_logits_match_transformers(checkpoints: dict[str, Path], arch: str) -> None:
    model, spec = load_hf_checkpoint(checkpoints[arch])
    model.eval()
    assert spec.arch == arch
    hf = AutoModelForCausalLM.from_pretrained(str(checkpoints[arch]), dtype=torch.float32).eval()
    assert type(hf).__name__ in spec.family.architectures
    tokens = torch.randint(4, 300, (3, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, ref = forward_logits(model, tokens), hf(tokens).logits
        logp = token_logprobs(model, tokens)
    assert ours.shape == ref.shape
    assert (ours - ref).abs().max().item() < TOLERANCE
    ref_logp = torch.log_softmax(ref, dim=-1)[:, :-1].gather(-1, tokens[:, 1:, None])[..., 0]
    assert (logp[:, 1:] - ref_logp).abs().max().item() < TOLERANCE


def test_qwen3_norms_q_and_k_per_head(checkpoints: dict[str, Path]) -> None:
    # A mapping that swapped the q and k norms (or dropped them) would not match transformers.
    model, spec = load_hf_checkpoint(checkpoints["qwen3"])
    attn = model.decoder.layers[0].self_attention
    assert spec.qk_layernorm and attn.q_layernorm.weight.shape == (spec.head_dim,)
    hf = read_hf_state_dict(checkpoints["qwen3"])
    assert torch.equal(attn.q_layernorm.weight, hf["model.layers.0.self_attn.q_norm.weight"])
    tokens = torch.randint(4, 300, (1, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = forward_logits(model, tokens)
        attn.q_layernorm.weight.copy_(hf["model.layers.0.self_attn.k_norm.weight"])
        assert (forward_logits(model, tokens) - before).abs().max().item() > 1e-3


@pytest.mark.parametrize("arch", FAMILY_NAMES)
def test_export_round_trip_is_identical(checkpoints: dict[str, Path], arch: str, tmp_path: Path) -> None:
    src = checkpoints[arch]
    model, spec = load_hf_checkpoint(src)
    original = read_hf_state_dict(src)
    exported = dict(iter_hf_tensors(model, spec))
    assert exported.keys() == original.keys()
    assert all(torch.equal(exported[k], t) for k, t in original.items())
    out = save_hf_checkpoint(model, spec, tmp_path / "out", source_dir=src)
    saved = load_file(str(out / "model.safetensors"))
    assert saved.keys() == original.keys() and all(torch.equal(saved[k], original[k]) for k in saved)
    AutoModelForCausalLM.from_pretrained(str(out))


@pytest.mark.parametrize("arch", [f.name for f in FAMILIES if f.moe is not None])
def test_recorded_routing_replays_with_no_flips(checkpoints: dict[str, Path], arch: str) -> None:
    model, spec = load_hf_checkpoint(checkpoints[arch])
    model.eval()
    tokens = torch.randint(4, 300, (3, 17), generator=torch.Generator().manual_seed(2))
    with torch.no_grad(), moe.record_routing(model) as rec:
        own = forward_logits(model, tokens)
    routing = moe.recorded_to_BSLK(rec, 3, 17)
    assert routing.shape == (3, 17, spec.num_layers, spec.moe.topk)
    with torch.no_grad(), moe.replay_routing(model, routing) as flips:
        replayed = forward_logits(model, tokens)
    assert torch.equal(own, replayed)
    assert (flips.flips, flips.compared) == (0, 3 * 17 * spec.num_layers)
    # Replaying other experts changes the output: the replay is really applied.
    with torch.no_grad(), moe.replay_routing(model, (routing + 1) % spec.moe.num_experts):
        assert not torch.equal(forward_logits(model, tokens), own)


def test_qwen3_moe_routing_matches_transformers(checkpoints: dict[str, Path]) -> None:
    # The same experts as transformers' router (softmax, top-k, norm_topk_prob), layer by layer.
    model, _ = load_hf_checkpoint(checkpoints["qwen3_moe"])
    hf = AutoModelForCausalLM.from_pretrained(str(checkpoints["qwen3_moe"]), dtype=torch.float32).eval()
    assert hf.config.norm_topk_prob
    tokens = torch.randint(4, 300, (1, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad(), moe.record_routing(model) as rec:
        forward_logits(model, tokens)
    with torch.no_grad():
        logits = hf(tokens, output_router_logits=True).router_logits
    for ours, theirs in zip(rec, logits):
        ref = torch.topk(torch.softmax(theirs.float(), -1), 2, dim=-1).indices
        assert torch.equal(ours.sort(dim=1).values, ref.sort(dim=1).values)
