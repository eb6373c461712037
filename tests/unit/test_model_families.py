"""Every registered model family, built by the Megatron model code from a tiny random checkpoint
made with transformers' own config class: its logits match transformers' (float32, max |diff|
< 1e-5), its weights round-trip HF -> Megatron -> HF bit for bit (and the exported directory
loads in transformers), and for the MoE families recorded routing replays with no flips. The
sigmoid routers (GLM-4.5, DeepSeek-V3) choose transformers' experts with the selection bias and
expert groups that change the choice here, keep that bias in float32 on export and fixed in
training; DeepSeek-V3 also without query compression and with YaRN RoPE."""
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
    if arch in ("glm4_moe", "deepseek_v3"):
        # One dense first layer, then MoE layers routing top-4 within the best 2 of 4 expert groups.
        kw.update(num_layers=3, num_experts_per_tok=4, n_group=4, topk_group=2, first_k_dense_replace=1)
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
    moe_layers = spec.num_layers - len(spec.moe.dense_layers)
    assert routing.shape == (3, 17, moe_layers, spec.moe.topk)
    with torch.no_grad(), moe.replay_routing(model, routing) as flips:
        replayed = forward_logits(model, tokens)
    assert torch.equal(own, replayed)
    assert (flips.flips, flips.compared) == (0, 3 * 17 * moe_layers)
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


def _hf_routing(hf, tokens: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per MoE layer of a transformers GLM/DeepSeek model: (router logits, e_score_correction_bias,
    the experts its router chose), captured from the router modules themselves."""
    out, hooks = [], []
    for module in hf.modules():
        if type(module).__name__.endswith("TopkRouter"):
            hooks.append(module.register_forward_hook(
                lambda m, _, o: out.append((o[0], m.e_score_correction_bias, o[2]))))
    try:
        with torch.no_grad():
            hf(tokens)
    finally:
        for h in hooks:
            h.remove()
    return out


@pytest.mark.parametrize("arch", ["glm4_moe", "deepseek_v3"])
def test_sigmoid_routing_matches_transformers_with_bias_and_expert_groups(checkpoints: dict[str, Path],
                                                                          arch: str) -> None:
    # GLM-4.5's and DeepSeek-V3's router: sigmoid scores plus a selection-only bias, top-4 within
    # the best 2 of 4 groups. The same experts as transformers' router, token by token, and the
    # checkpoint is one where dropping the groups or the bias would choose other experts, so a
    # mapping that lost either fails here.
    model, spec = load_hf_checkpoint(checkpoints[arch])
    assert spec.moe.groups == (4, 2) and spec.moe.dense_layers == (0,)
    assert spec.rotary_percent == (0.5 if arch == "glm4_moe" else 1.0)
    hf = AutoModelForCausalLM.from_pretrained(str(checkpoints[arch]), dtype=torch.float32).eval()
    tokens = torch.randint(4, 300, (1, 64), generator=torch.Generator().manual_seed(4))
    with torch.no_grad(), moe.record_routing(model) as rec:
        forward_logits(model, tokens)
    theirs = _hf_routing(hf, tokens)
    assert len(rec) == len(theirs) == spec.num_layers - 1
    ungrouped = unbiased = 0
    for ours, (logits, bias, chosen) in zip(rec, theirs):
        assert torch.equal(ours.sort(dim=1).values, chosen.sort(dim=1).values)
        scores = torch.sigmoid(logits.float())
        plain = torch.topk(scores + bias, 4, dim=-1).indices
        ungrouped += int((plain.sort(dim=1).values != chosen.sort(dim=1).values).any(dim=1).sum())
        no_bias = torch.topk(scores, 4, dim=-1).indices
        unbiased += int((no_bias.sort(dim=1).values != plain.sort(dim=1).values).any(dim=1).sum())
    assert ungrouped > 0 and unbiased > 0, (ungrouped, unbiased)


def test_deepseek_v3_without_query_compression_matches_transformers(tmp_path: Path) -> None:
    # q_lora_rank null (DeepSeek-V2-Lite's shape): queries come from q_proj, not q_a/q_b.
    d = make_tiny_checkpoint(tmp_path / "v3", seed=5, q_lora_rank=None, **tiny_kwargs("deepseek_v3"))
    model, spec = load_hf_checkpoint(d)
    assert spec.mla.q_lora_rank is None and hasattr(model.decoder.layers[0].self_attention, "linear_q_proj")
    hf = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()
    tokens = torch.randint(4, 300, (2, 24), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        assert (forward_logits(model.eval(), tokens) - hf(tokens).logits).abs().max().item() < TOLERANCE


def test_deepseek_v3_with_yarn_rope_matches_transformers(tmp_path: Path) -> None:
    # The full DeepSeek-V3's and Kimi K2's RoPE: YaRN, here at 100 tokens past an original
    # context of 32. Built without it, the same weights give other logits, so it is really mapped.
    import dataclasses

    from kiln.models.hf_io import hf_to_megatron_shard, load_state_into
    from kiln.models.megatron_model import build_gpt_model

    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "mscale": 1.0,
            "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}
    d = make_tiny_checkpoint(tmp_path / "v3", seed=7, rope_scaling=yarn, **tiny_kwargs("deepseek_v3"))
    model, spec = load_hf_checkpoint(d)
    assert dict(spec.mla.yarn)["rotary_scaling_factor"] == 4.0
    hf = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()
    tokens = torch.randint(4, 300, (2, 100), generator=torch.Generator().manual_seed(8))
    plain_spec = dataclasses.replace(spec, mla=dataclasses.replace(spec.mla, yarn=()))
    plain = build_gpt_model(plain_spec, 1)
    load_state_into(plain, hf_to_megatron_shard(read_hf_state_dict(d), plain_spec, 0, 1))
    with torch.no_grad():
        ours, ref = forward_logits(model.eval(), tokens), hf(tokens).logits
        assert (ours - ref).abs().max().item() < TOLERANCE
        assert (forward_logits(plain.eval(), tokens) - ref).abs().max().item() > 1e-3


def test_a_bfloat16_export_keeps_the_routing_bias_in_float32(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    # As transformers keeps it: rounded to bfloat16, the selection bias would route other
    # experts than the trainer's float32 one.
    model, spec = load_hf_checkpoint(checkpoints["glm4_moe"])
    out = save_hf_checkpoint(model, spec, tmp_path / "bf16", source_dir=checkpoints["glm4_moe"],
                             dtype=torch.bfloat16)
    saved = load_file(str(out / "model.safetensors"))
    bias = saved["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert bias.dtype == torch.float32
    assert torch.equal(bias, read_hf_state_dict(checkpoints["glm4_moe"])["model.layers.1.mlp.gate.e_score_correction_bias"])
    assert saved["model.layers.1.mlp.gate.weight"].dtype == torch.bfloat16


def test_training_leaves_the_routing_bias_as_the_checkpoint_has_it(checkpoints: dict[str, Path]) -> None:
    # Megatron's aux-loss-free balancing would move the selection bias after every step where
    # finalize_model_grads runs; RL keeps the checkpoint's routing (update rate 0).
    from megatron.core.distributed.finalize_model_grads import _update_router_expert_bias

    model, _ = load_hf_checkpoint(checkpoints["glm4_moe"])
    model.train()
    before = [b.clone() for n, b in model.named_buffers() if n.endswith("router.expert_bias")]
    tokens = torch.randint(4, 300, (2, 32), generator=torch.Generator().manual_seed(9))
    forward_logits(model, tokens).float().logsumexp(-1).mean().backward()
    assert any(m.local_tokens_per_expert.sum() > 0 for m in model.modules() if hasattr(m, "expert_bias"))
    _update_router_expert_bias([model], model.config)
    after = [b for n, b in model.named_buffers() if n.endswith("router.expert_bias")]
    assert len(after) == 2 and all(torch.equal(a, b) for a, b in zip(before, after))
