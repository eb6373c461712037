"""Multi-latent attention (DeepSeek-V3, Kimi K2) in the Megatron model.

MLA compresses keys and values into one latent per token: `kv_a_proj_with_mqa` maps the hidden
state to `kv_lora_rank` latent dimensions plus one `qk_rope_head_dim` RoPE key shared by all
heads; after an RMSNorm of the latent, `kv_b_proj` expands it to each head's `qk_nope_head_dim`
key and `v_head_dim` value. Queries are compressed the same way when `q_lora_rank` is set
(`q_a_proj`, `q_a_layernorm`, `q_b_proj`), else projected directly (`q_proj`). A head's query
and key are [nope | rope] (`qk_nope_head_dim + qk_rope_head_dim` wide), its value narrower.

Megatron-core builds this as `MLASelfAttention` (local spec, `multi_latent_attention=True`), with
the same layouts: each HF tensor is one Megatron tensor, so the weight table
(`kiln.api.model_families.MLA_NAMES`) only renames. Two details are the family's business and
are configured here or in the registry: the q/kv latent norms are Megatron's `qk_layernorm`
modules (the family entry sets `qk_layernorm`), and RoPE is
DeepSeek's interleaved form (transformers' `rope_interleave`), which Megatron's MLA always
applies (it de-interleaves the rotary dimensions before rotating halves).

YaRN RoPE scaling (the full DeepSeek-V3's and Kimi K2's) is Megatron's MLA `rope_type="yarn"`.

Not covered: tensor parallelism (MoE families train at 1), latent caching for inference.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class MLASpec:
    q_lora_rank: int | None
    """None: queries are projected directly (`q_proj`)."""
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    yarn: tuple[tuple[str, float], ...] = ()
    """YaRN RoPE scaling as Megatron's MLATransformerConfig names it; empty: plain RoPE."""

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> "MLASpec":
        return cls(q_lora_rank=config.get("q_lora_rank"), kv_lora_rank=config["kv_lora_rank"],
                   qk_nope_head_dim=config["qk_nope_head_dim"], qk_rope_head_dim=config["qk_rope_head_dim"],
                   v_head_dim=config["v_head_dim"], yarn=_yarn(config))

    @property
    def weight_flags(self) -> set[str]:
        return {"q_lora" if self.q_lora_rank else "q_direct"}

    def transformer_config(self) -> dict[str, Any]:
        """`MLATransformerConfig` keyword arguments."""
        return dict(
            multi_latent_attention=True,
            q_lora_rank=self.q_lora_rank,
            kv_lora_rank=self.kv_lora_rank,
            qk_head_dim=self.qk_nope_head_dim,
            qk_pos_emb_head_dim=self.qk_rope_head_dim,
            v_head_dim=self.v_head_dim,
            # Plain RoPE; 1.0 keeps the softmax scale at 1/sqrt(qk head dim), as transformers'.
            **({"rope_type": "yarn", **dict(self.yarn)} if self.yarn
               else {"rope_type": "rope", "rotary_scaling_factor": 1.0}),
        )


def _yarn(config: dict[str, Any]) -> tuple[tuple[str, float], ...]:
    """DeepSeek's YaRN settings (`rope_scaling` in hub checkpoints, `rope_parameters` in
    transformers 5) with transformers' defaults, under Megatron's names. Both sides compute the
    cos/sin factor mscale(factor, mscale) / mscale(factor, mscale_all_dim) and scale the softmax
    by mscale(factor, mscale_all_dim)^2."""
    for field in ("rope_scaling", "rope_parameters"):
        r = config.get(field) or {}
        if r.get("rope_type", r.get("type")) == "yarn":
            return (("rotary_scaling_factor", float(r["factor"])),
                    ("original_max_position_embeddings", int(r["original_max_position_embeddings"])),
                    ("beta_fast", float(r.get("beta_fast") or 32)), ("beta_slow", float(r.get("beta_slow") or 1)),
                    ("mscale", float(r.get("mscale") or 1.0)), ("mscale_all_dim", float(r.get("mscale_all_dim") or 0.0)))
    return ()


def patch_megatron_without_te() -> None:
    """Megatron-core 0.16.1's MLA module sets HAVE_TE when its transformer-engine extension
    imports, which it does without transformer-engine (its classes are then mock objects), and
    then calls isinstance(x, <mock>). Only the transformer-engine paths read the flag."""
    from megatron.core.transformer import multi_latent_attention

    if not isinstance(multi_latent_attention.TELinear, type):
        multi_latent_attention.HAVE_TE = False
