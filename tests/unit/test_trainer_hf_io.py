"""HF <-> Megatron weight mapping at TP=1: logits match transformers, export round-trips."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from kiln.models.tiny import make_tiny_checkpoint
from kiln.models import parallel
from kiln.models.hf_io import (
    fuse_qkv,
    iter_hf_tensors,
    load_hf_checkpoint,
    read_hf_state_dict,
    save_hf_checkpoint,
    split_qkv,
)
from kiln.models.megatron_model import ArchSpec, forward_logits, token_logprobs

CASES = {
    "qwen2": dict(arch="qwen2"),
    "llama": dict(arch="llama"),
    "qwen2_tied_gqa4": dict(arch="qwen2", num_heads=8, num_kv_heads=2, tie_word_embeddings=True),
    "llama_mha": dict(arch="llama", num_heads=4, num_kv_heads=4),
}


@pytest.fixture(scope="module", autouse=True)
def _pg() -> None:
    parallel.init_parallel(1)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpts")
    return {
        name: make_tiny_checkpoint(root / name, hidden_size=64, num_layers=2, intermediate_size=128, seed=i, **kw)
        for i, (name, kw) in enumerate(CASES.items())
    }


@pytest.mark.parametrize("attention", ["sdpa", "megatron"])
@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(checkpoints: dict[str, Path], case: str, attention: str) -> None:
    model, spec = load_hf_checkpoint(checkpoints[case], tp=1, attention=attention)
    hf = AutoModelForCausalLM.from_pretrained(str(checkpoints[case]), dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, spec.vocab_size, (3, 40), generator=g)
    with torch.no_grad():
        ours = forward_logits(model, tokens)
        ref = hf(tokens).logits
        logp = token_logprobs(model, tokens)
    assert ours.shape == ref.shape
    assert (ours - ref).abs().max().item() <= 1e-5
    ref_logp = torch.log_softmax(ref, dim=-1)[:, :-1].gather(-1, tokens[:, 1:, None])[..., 0]
    assert logp[:, 0].eq(0).all()
    assert (logp[:, 1:] - ref_logp).abs().max().item() <= 1e-5


@pytest.mark.parametrize("case", ["qwen2", "qwen2_tied_gqa4"])
def test_export_round_trip_is_identical(checkpoints: dict[str, Path], case: str, tmp_path: Path) -> None:
    src = checkpoints[case]
    model, spec = load_hf_checkpoint(src, tp=1)
    original = read_hf_state_dict(src)
    exported = dict(iter_hf_tensors(model, spec))
    assert list(exported) and exported.keys() == original.keys()
    for name, t in original.items():
        assert torch.equal(exported[name], t), name
    out = save_hf_checkpoint(model, spec, tmp_path / "out", source_dir=src)
    saved = load_file(str(out / "model.safetensors"))
    assert saved.keys() == original.keys() and all(torch.equal(saved[k], original[k]) for k in saved)
    assert (out / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()
    assert not list(tmp_path.glob(".out.tmp*"))
    # The written directory is a checkpoint transformers loads.
    AutoModelForCausalLM.from_pretrained(str(out))


def test_export_follows_training_updates(checkpoints: dict[str, Path]) -> None:
    model, spec = load_hf_checkpoint(checkpoints["llama"], tp=1)
    with torch.no_grad():
        model.decoder.layers[1].mlp.linear_fc1.weight[0, 0] += 1.0  # first gate row
        model.decoder.layers[0].self_attention.linear_qkv.weight[-1, 0] += 1.0  # last v row
    exported = dict(iter_hf_tensors(model, spec))
    original = read_hf_state_dict(checkpoints["llama"])
    changed = sorted(k for k in original if not torch.equal(original[k], exported[k]))
    assert changed == ["model.layers.0.self_attn.v_proj.weight", "model.layers.1.mlp.gate_proj.weight"]
    assert exported["model.layers.0.self_attn.v_proj.weight"][-1, 0] == original["model.layers.0.self_attn.v_proj.weight"][-1, 0] + 1


def test_fuse_split_qkv_inverse() -> None:
    spec = ArchSpec("llama", 64, 48, 96, 1, num_heads=6, num_kv_heads=3, head_dim=8,
                    max_position_embeddings=16, rms_norm_eps=1e-6, rope_theta=1e4,
                    qkv_bias=True, tie_word_embeddings=False)
    q, k, v = torch.randn(48, 48), torch.randn(24, 48), torch.randn(24, 48)
    fused = fuse_qkv(q, k, v, spec)
    # Group 0 = query heads 0-1, then key head 0, then value head 0.
    assert torch.equal(fused[:16], q[:16]) and torch.equal(fused[16:24], k[:8]) and torch.equal(fused[24:32], v[:8])
    q2, k2, v2 = split_qkv(fused, spec)
    assert torch.equal(q, q2) and torch.equal(k, k2) and torch.equal(v, v2)


def test_unsupported_tp_split_is_a_clear_error(checkpoints: dict[str, Path]) -> None:
    spec = ArchSpec.from_dir(checkpoints["qwen2"])
    with pytest.raises(ValueError, match="num_key_value_heads"):
        spec.check_tp(4)


def test_unsupported_architecture_is_rejected() -> None:
    with pytest.raises(ValueError, match="architectures"):
        ArchSpec.from_hf_config({"architectures": ["GPT2LMHeadModel"]})
