"""Expert parallelism without processes: which rank holds which expert under which name (the
loading and export order of `hf_io`), and the refusals naming `spec.trainer.expertParallel`.
Two ranks on gloo against one: tests/integration/test_trainer_expert_parallel.py."""
from __future__ import annotations

import pytest

from kiln.api.capabilities import Target, model_refusals, spec_refusals
from kiln.models.arch import ArchSpec
from kiln.models.hf_io import expert_split_rows, weight_rows

from helpers.capabilities import MOE, checkpoint_config

GLM = {"architectures": ["Glm4MoeForCausalLM"], "hidden_size": 64, "num_attention_heads": 2,
       "num_key_value_heads": 1, "intermediate_size": 128, "vocab_size": 512, "num_hidden_layers": 3,
       "max_position_embeddings": 128, "n_routed_experts": 8, "num_experts_per_tok": 4,
       "moe_intermediate_size": 32, "n_group": 4, "topk_group": 2, "first_k_dense_replace": 1,
       "n_shared_experts": 1, "norm_topk_prob": True}


def test_each_expert_has_one_owner_under_its_local_name() -> None:
    spec = ArchSpec.from_hf_config(GLM)
    unsplit = list(weight_rows(spec))
    rows = list(expert_split_rows(spec, 2))
    # The same rows in the same order (what weight sync buckets), HF names unchanged.
    assert [names for _, _, names, _ in rows] == [names for _, _, names in unsplit]
    experts = [(m, names[0], owner) for _, m, names, owner in rows if owner is not None]
    assert {owner for *_, owner in experts} == {0, 1}
    for m, hf, owner in experts:
        e = int(hf.split(".experts.")[1].split(".")[0])
        assert owner == e // 4 and f".local_experts.{e % 4}." in m
    # Each rank's shard names its own experts only, every expert exactly once over the ranks.
    owned = [sorted(hf for _, hf, o in experts if o == r) for r in (0, 1)]
    assert not set(owned[0]) & set(owned[1])
    assert sorted(owned[0] + owned[1]) == sorted(hf for _, hf, _ in experts)
    # Dense layers and shared experts stay on every rank.
    assert all(owner is None for _, m, _, owner in rows if ".local_experts." not in m)


def test_the_model_refuses_a_split_it_cannot_make() -> None:
    spec = ArchSpec.from_hf_config(GLM)
    spec.check_ep(2)
    with pytest.raises(ValueError, match="expert_parallel=3 does not divide the 8 experts"):
        spec.check_ep(3)
    with pytest.raises(ValueError, match="tensor_parallel 1 only"):
        spec.check_ep(2, tp=2)
    dense = ArchSpec.from_hf_config({**GLM, "architectures": ["Qwen3ForCausalLM"]})
    with pytest.raises(ValueError, match="expert_parallel=2: Qwen3 has no experts"):
        dense.check_ep(2)


@pytest.mark.parametrize(("fields", "message"), [
    ({"dataParallel": 3, "expertParallel": 2}, "expertParallel 2 must divide dataParallel 3"),
    ({"dataParallel": 2, "expertParallel": 2, "tensorParallel": 2}, "expertParallel 2 needs tensorParallel 1"),
])
def test_the_spec_refuses_a_rank_layout_without_expert_groups(fields, message) -> None:
    (refusal,) = [r for r in spec_refusals(_spec(fields)) if r.capability.name == "expert-parallel-layout"]
    assert str(refusal).startswith(f"spec.trainer.expertParallel: {message}")
    assert not [r for r in spec_refusals(_spec({"dataParallel": 4, "expertParallel": 2}))
                if r.capability.name == "expert-parallel-layout"]


def _spec(trainer: dict):
    from kiln.api.spec import RLJobSpec

    return RLJobSpec.model_validate({
        "model": {"path": "m"}, "tasks": [{"name": "t", "env": "chain", "generate": {"count": 4}}],
        "stages": [{"name": "s", "type": "sft", "tasks": ["t"]}], "trainer": trainer})


def test_the_capability_names_the_expert_count(tmp_path) -> None:
    moe = checkpoint_config(tmp_path / "moe", **MOE)
    ok = model_refusals(moe, Target(engine="megatron", expert_parallel=4))
    assert not [r for r in ok if r.capability.name == "expert-parallel"]
    (refusal,) = [r for r in model_refusals(moe, Target(engine="megatron", expert_parallel=3))
                  if r.capability.name == "expert-parallel"]
    assert str(refusal) == ("spec.trainer.expertParallel: expertParallel 3 does not divide the 8 experts of each "
                            "MoE layer (config.json num_experts)")
    dense = checkpoint_config(tmp_path / "dense")
    (refusal,) = [r for r in model_refusals(dense, Target(engine="megatron", expert_parallel=2))
                  if r.capability.name == "expert-parallel"]
    assert "no experts to split" in str(refusal)
