"""Hugging Face <-> Megatron-core weight names, one table per layout, read in both directions by
`kiln.models.hf_io` (its loader and its streaming iterator for weight sync and export).

A table is data: each row names a Megatron parameter, the HF tensor(s) it is made of, how they
combine and split over tensor-parallel ranks (`WeightKind`), and the model flag without which
the row does not exist. The family entries (`kiln.api.model_families`) pick a table; torch-free.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

WeightKind = Literal["copy", "column", "row", "qkv", "gate_up"]
"""How one Megatron tensor is made of its HF tensor(s), and how tensor parallelism splits it:
`copy` one to one, replicated; `column` one to one, rows split over ranks; `row` one to one,
columns split; `qkv` q, k and v fused per KV group (rows split: whole groups per rank); `gate_up`
gate and up stacked per rank (each rank holds its gate rows, then its up rows)."""


@dataclass(frozen=True)
class Weight:
    """One row of a weight table: a Megatron parameter and the HF tensor(s) it is made of.
    Names may hold `{e}` (the expert index); `when` names a flag of the built model
    (`WeightTable.rows`) without which the row does not exist."""

    megatron: str
    hf: tuple[str, ...]
    kind: WeightKind = "copy"
    when: str | None = None
    float32: bool = False
    """Written in float32 whatever the checkpoint's dtype (transformers keeps it so: a routing
    bias rounded to bfloat16 would choose other experts than the trainer's float32 one)."""

    def float32_names(self) -> tuple[str, ...]:
        return self.hf if self.float32 else ()


def _w(megatron: str, hf: str | tuple[str, ...], kind: WeightKind = "copy", when: str | None = None,
       float32: bool = False) -> Weight:
    return Weight(megatron, (hf,) if isinstance(hf, str) else hf, kind, when, float32)


@dataclass(frozen=True)
class WeightTable:
    """Megatron <-> HF names. `model` rows are whole names; `layer`, `dense_mlp` and `moe` rows
    are under `decoder.layers.{i}.` / `model.layers.{i}.`; `expert` rows are per expert."""

    model: tuple[Weight, ...]
    layer: tuple[Weight, ...]
    dense_mlp: tuple[Weight, ...]
    moe: tuple[Weight, ...] = ()
    expert: tuple[Weight, ...] = ()

    @staticmethod
    def rows(rows: tuple[Weight, ...], flags: set[str]) -> list[Weight]:
        """The rows that exist in a model with `flags` (e.g. {"qkv_bias", "untied"})."""
        return [r for r in rows if r.when is None or r.when in flags]

    def float32_suffixes(self) -> set[str]:
        """HF name endings of the tensors kept in float32."""
        return {n for rows in (self.model, self.layer, self.dense_mlp, self.moe, self.expert)
                for r in rows for n in r.float32_names()}


_QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")

LLAMA_NAMES = WeightTable(
    model=(
        _w("embedding.word_embeddings.weight", "model.embed_tokens.weight", "column"),
        _w("decoder.final_layernorm.weight", "model.norm.weight"),
        _w("output_layer.weight", "lm_head.weight", "column", when="untied"),
    ),
    layer=(
        _w("input_layernorm.weight", "input_layernorm.weight"),
        _w("self_attention.linear_qkv.weight", tuple(f"{p}.weight" for p in _QKV), "qkv"),
        _w("self_attention.linear_qkv.bias", tuple(f"{p}.bias" for p in _QKV), "qkv", when="qkv_bias"),
        _w("self_attention.q_layernorm.weight", "self_attn.q_norm.weight", when="qk_layernorm"),
        _w("self_attention.k_layernorm.weight", "self_attn.k_norm.weight", when="qk_layernorm"),
        _w("self_attention.linear_proj.weight", "self_attn.o_proj.weight", "row"),
        # Kiln's DeepSeek-sparse-attention indexer (config.json `kiln_dsa`), replicated.
        *(_w(f"self_attention.indexer.{n}.weight", f"self_attn.indexer.{n}.weight", when="dsa")
          for n in ("wq", "wk", "weights_proj")),
        _w("pre_mlp_layernorm.weight", "post_attention_layernorm.weight"),
    ),
    dense_mlp=(
        _w("mlp.linear_fc1.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight"), "gate_up"),
        _w("mlp.linear_fc2.weight", "mlp.down_proj.weight", "row"),
    ),
    moe=(
        _w("mlp.router.weight", "mlp.gate.weight"),
        _w("mlp.shared_experts.linear_fc1.weight",
           ("mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.up_proj.weight"), "gate_up",
           when="shared_expert"),
        _w("mlp.shared_experts.linear_fc2.weight", "mlp.shared_expert.down_proj.weight", "row",
           when="shared_expert"),
        _w("mlp.shared_experts.gate_weight", "mlp.shared_expert_gate.weight", when="shared_expert_gate"),
    ),
    expert=(
        _w("mlp.experts.local_experts.{e}.linear_fc1.weight",
           ("mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight"), "gate_up"),
        _w("mlp.experts.local_experts.{e}.linear_fc2.weight", "mlp.experts.{e}.down_proj.weight", "row"),
    ),
)
"""The Llama layout, shared by Qwen2, Qwen3 and their MoE variants (per-expert hub names, which
are also the names vLLM loads)."""

DEEPSEEK_MOE_NAMES = WeightTable(
    model=LLAMA_NAMES.model, layer=LLAMA_NAMES.layer, dense_mlp=LLAMA_NAMES.dense_mlp,
    moe=(
        _w("mlp.router.weight", "mlp.gate.weight"),
        # Megatron's router keeps the selection bias as a float32 buffer, never trained.
        _w("mlp.router.expert_bias", "mlp.gate.e_score_correction_bias", when="expert_bias", float32=True),
        _w("mlp.shared_experts.linear_fc1.weight",
           ("mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.up_proj.weight"), "gate_up",
           when="shared_expert"),
        _w("mlp.shared_experts.linear_fc2.weight", "mlp.shared_experts.down_proj.weight", "row",
           when="shared_expert"),
    ),
    expert=LLAMA_NAMES.expert,
)
"""DeepSeek's MoE layout (GLM-4.5 keeps it): `shared_experts` (plural, no gate) and the router's
`e_score_correction_bias`."""

_MLA = "self_attention."
MLA_NAMES = WeightTable(
    model=LLAMA_NAMES.model,
    layer=(
        _w("input_layernorm.weight", "input_layernorm.weight"),
        _w(_MLA + "linear_q_proj.weight", "self_attn.q_proj.weight", "column", when="q_direct"),
        _w(_MLA + "linear_q_down_proj.weight", "self_attn.q_a_proj.weight", when="q_lora"),
        _w(_MLA + "q_layernorm.weight", "self_attn.q_a_layernorm.weight", when="q_lora"),
        _w(_MLA + "linear_q_up_proj.weight", "self_attn.q_b_proj.weight", "column", when="q_lora"),
        _w(_MLA + "linear_kv_down_proj.weight", "self_attn.kv_a_proj_with_mqa.weight"),
        _w(_MLA + "kv_layernorm.weight", "self_attn.kv_a_layernorm.weight"),
        _w(_MLA + "linear_kv_up_proj.weight", "self_attn.kv_b_proj.weight", "column"),
        _w(_MLA + "linear_proj.weight", "self_attn.o_proj.weight", "row"),
        # DeepSeek-V3.2: Kiln's lightning indexer, replicated (see `kiln.models.dsa`).
        *(_w(f"self_attention.indexer.{n}.weight", f"self_attn.indexer.{n}.weight", when="dsa")
          for n in ("wq", "wk", "weights_proj")),
        _w("pre_mlp_layernorm.weight", "post_attention_layernorm.weight"),
    ),
    dense_mlp=LLAMA_NAMES.dense_mlp, moe=DEEPSEEK_MOE_NAMES.moe, expert=LLAMA_NAMES.expert,
)
"""DeepSeek-V3's multi-latent attention: each HF projection is one Megatron tensor, laid out
alike (see `kiln.models.mla`); the q/kv latent norms are Megatron's q/kv layernorms."""
