"""DeepSeek-V3.2's shape (`DeepseekV32ForCausalLM`): DeepSeek-V3's multi-latent attention and
MoE, with each query's keys chosen by Kiln's lightning indexer (`index_topk`, `index_n_heads`,
`index_head_dim`). With a top-k that covers the sequence it is DeepSeek-V3 (transformers'
logits); below it, the selection is really the indexer's top-k; a one-sequence forward (the
megatron rollout engine's) reproduces the batched trainer forward bit for bit, selected indices
included, through the MoE layers; vLLM is refused with its reason."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from kiln.api.capabilities import Target, model_refusals, rollout_engine
from kiln.api.model_families import config_problems
from kiln.kernels.dsa import indexer_scores_reference, topk_indices_reference
from kiln.models import dsa, parallel
from kiln.models.hf_io import load_hf_checkpoint
from kiln.models.megatron_model import forward_logits, next_token_logprob, token_logprobs
from kiln.models.tiny import make_tiny_checkpoint

# One dense first layer, then MoE layers routing top-4 within the best 2 of 4 expert groups.
TINY = dict(hidden_size=64, num_layers=3, num_heads=2, num_kv_heads=1, intermediate_size=128, num_experts=8,
            num_experts_per_tok=4, moe_intermediate_size=32, n_group=4, topk_group=2, first_k_dense_replace=1)
TOPK = 8


@pytest.fixture(scope="module", autouse=True)
def _pg() -> None:
    parallel.init_parallel(1)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """DeepSeek-V3 and V3.2 checkpoints of the same seed: the same weights, plus an indexer."""
    root = tmp_path_factory.mktemp("v32")
    return {"v3": make_tiny_checkpoint(root / "v3", seed=3, arch="deepseek_v3", **TINY),
            "v32": make_tiny_checkpoint(root / "v32", seed=3, arch="deepseek_v32", index_topk=TOPK, **TINY)}


@pytest.fixture(scope="module")
def sparse(dirs: dict[str, Path]):
    model, spec = load_hf_checkpoint(dirs["v32"], dsa_backend="torch")
    return model.eval(), spec


def _tokens(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(4, 300, (batch, length), generator=torch.Generator().manual_seed(seed))


def _with_topk(model, k: int):
    """Set every layer's index_topk (the module's config object is shared only by its layer)."""
    for layer in dsa.dsa_layers(model):
        layer.indexer.dsa = dsa.DSAConfig(k, layer.indexer.dsa.index_heads, layer.indexer.dsa.index_dim)


def test_config_is_deepseek_v32s_and_builds_sparse_mla(dirs: dict[str, Path], sparse) -> None:
    cfg = json.loads((dirs["v32"] / "config.json").read_text())
    assert cfg["architectures"] == ["DeepseekV32ForCausalLM"] and cfg["model_type"] == "deepseek_v32"
    model, spec = sparse
    assert spec.arch == "deepseek_v32" and spec.mla is not None and spec.moe is not None
    assert spec.dsa == dsa.DSAConfig(TOPK, 2, 16)
    layers = dsa.dsa_layers(model)
    assert [type(m).__name__ for m in layers] == ["DSAMLASelfAttention"] * 3
    assert not any(p.requires_grad for _, p in dsa.indexer_parameters(model))
    # A missing or non-positive indexer field is refused, naming it.
    for field, value in (("index_topk", None), ("index_n_heads", 0), ("index_head_dim", "16")):
        bad = {**cfg, field: value} if value is not None else {k: v for k, v in cfg.items() if k != field}
        problems = config_problems(bad)
        assert problems and field in problems[0], problems


def test_with_topk_covering_the_sequence_it_is_deepseek_v3(dirs: dict[str, Path], sparse) -> None:
    model, _ = sparse
    hf = AutoModelForCausalLM.from_pretrained(str(dirs["v3"]), dtype=torch.float32).eval()
    tokens = _tokens(2, 40)
    _with_topk(model, 64)
    try:
        with torch.no_grad():
            dense = forward_logits(model, tokens)
            assert (dense - hf(tokens).logits).abs().max().item() < 1e-5
    finally:
        _with_topk(model, TOPK)
    with torch.no_grad():
        ours = forward_logits(model, tokens)
    # Positions with at most k earlier tokens see them all; later ones only the indexer's k.
    assert (ours[:, :TOPK] - dense[:, :TOPK]).abs().max().item() < 1e-5
    assert (ours[:, TOPK + 1:] - dense[:, TOPK + 1:]).abs().max().item() > 1e-3


def test_selected_keys_are_the_indexers_top_k(sparse) -> None:
    model, _ = sparse
    layer0 = dsa.dsa_layers(model)[0]
    seen = {}
    hook = layer0.register_forward_pre_hook(lambda m, args: seen.setdefault("h", args[0].detach().clone()))
    with torch.no_grad(), dsa.record_indices(model) as rec:
        forward_logits(model, _tokens(1, 30))
    hook.remove()
    assert sorted(rec) == [1, 2, 3] and rec[1].shape == (1, 32, TOPK)  # padded to 32 rows
    h, ix = seen["h"], layer0.indexer
    q = ix.wq(h).view(h.shape[0], 1, 2, 16).transpose(0, 1).contiguous()
    k = ix.wk(h).transpose(0, 1).contiguous()
    w = ix.weights_proj(h).transpose(0, 1).contiguous()
    assert torch.equal(rec[1], topk_indices_reference(indexer_scores_reference(q, k, w, offset=0), TOPK))


def test_one_sequence_forward_reproduces_the_batched_one_bit_for_bit(sparse) -> None:
    """What the megatron rollout engine relies on (`kiln consistency --engine megatron`): its
    one-sequence prefix forwards give the trainer's batched log-probs and index hashes exactly,
    through the MoE layers whose experts see batch-dependent token counts."""
    model, _ = sparse
    lengths = [37, 12, 5]
    seqs = [_tokens(1, n, seed=i)[0] for i, n in enumerate(lengths)]
    batch = torch.zeros(3, 37, dtype=torch.long)
    for i, s in enumerate(seqs):
        batch[i, : len(s)] = s
    with torch.no_grad(), dsa.record_indices(model) as rec:
        lp = token_logprobs(model, batch)
        batch_hashes = [dsa.sequence_hashes(rec, i, n) for i, n in enumerate(lengths)]
        for i, s in enumerate(seqs):
            for t in range(1, len(s)):
                logits = forward_logits(model, s[None, :t])[0, -1]
                assert next_token_logprob(logits, int(s[t])) == float(lp[i, t]), (i, t)
            forward_logits(model, s[None, :-1])
            assert dsa.sequence_hashes(rec, 0, len(s)) == batch_hashes[i]


def test_rollout_is_the_megatron_engine_and_vllm_is_refused_with_the_reason(dirs: dict[str, Path]) -> None:
    cfg = json.loads((dirs["v32"] / "config.json").read_text())
    assert rollout_engine("auto", cfg, cuda=False) == rollout_engine("auto", cfg, cuda=True) == "megatron"
    for cuda in (False, True):
        refusals = model_refusals(dirs["v32"], Target(engine="vllm", cuda=cuda))
        assert [r.capability.name for r in refusals] == ["vllm-cpu-mla"]
        assert "sparse attention" in refusals[0].message and "megatron" in refusals[0].message
    assert model_refusals(dirs["v32"], Target(engine="megatron", cuda=False)) == []


@pytest.mark.slow
def test_consistency_command_is_bit_identical_with_equal_index_hashes(dirs: dict[str, Path]) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kiln.cli.main", "consistency", "--model", str(dirs["v32"]), "--engine", "megatron",
         "--dsa-backend", "torch", "--samples", "3", "--max-tokens", "16"],
        capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "engine megatron, model DSA, dtype float32" in proc.stdout
    rows = re.findall(r"^\s+(\d+)\s+(\d+)\s+(\S+)\s+(\S+)\s+(OK|MISMATCH)$", proc.stdout, re.M)
    assert [r[0] for r in rows] == ["0", "1"], proc.stdout
    for _, n, mx, mean, verdict in rows:
        assert int(n) > 0 and float(mx) == 0.0 and float(mean) == 0.0 and verdict == "OK"
    hashes = re.findall(r"^version (\d): index hashes (\d+)/(\d+) .* (OK|MISMATCH)$", proc.stdout, re.M)
    assert hashes == [("0", "9", "9", "OK"), ("1", "9", "9", "OK")], proc.stdout
