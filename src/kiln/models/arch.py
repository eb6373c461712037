"""`ArchSpec`: the shape of one checkpoint's Megatron model, read from its config.json through
the family registry (`kiln.api.model_families`).

Which fields config.json may have and what they mean is the family entry's business; this module
only applies it: `from_hf_config` refuses what `config_problems` refuses (one line naming the
field) and reads the dimensions, the attention flags and, for a mixture of experts, the
`MoESpec`. `weight_flags` says which conditional rows of the family's weight table exist.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from kiln.api.model_families import BY_NAME, SUPPORTED_ARCHS, Family, config_problems, dsa_entry, family_of
from kiln.models.dsa import DSAConfig
from kiln.models.mla import MLASpec
from kiln.models.moe import MoESpec


@dataclass(frozen=True)
class ArchSpec:
    """The parts of a HF config that decide the Megatron model's shape."""

    arch: str
    """The family's name (`kiln.api.model_families.Family.name`)."""
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    qkv_bias: bool
    tie_word_embeddings: bool
    dsa: DSAConfig | None = None
    """DeepSeek sparse attention settings (config.json `kiln_dsa`, or DeepSeek-V3.2's `index_*`
    fields); None for dense attention."""
    moe: MoESpec | None = None
    """Mixture-of-experts settings; None for a dense MLP."""
    qk_layernorm: bool = False
    """RMSNorm over each head of q and k before RoPE (Qwen3)."""
    rotary_percent: float = 1.0
    """The share of each head's dimensions RoPE rotates (GLM-4.5: 0.5)."""
    mla: MLASpec | None = None
    """Multi-latent attention (DeepSeek-V3); None for grouped-query attention."""

    @property
    def family(self) -> Family:
        return BY_NAME[self.arch]

    def weight_flags(self) -> set[str]:
        """The `when` flags of the family's weight table that hold for this model."""
        flags = {name for name, on in (
            ("qkv_bias", self.qkv_bias), ("qk_layernorm", self.qk_layernorm),
            ("untied", not self.tie_word_embeddings), ("dsa", self.dsa is not None)) if on}
        if self.mla is not None:
            flags |= self.mla.weight_flags
        if self.moe is not None and self.moe.expert_bias:
            flags.add("expert_bias")
        if self.moe is not None and self.moe.shared_ffn_hidden_size:
            flags.add("shared_expert")
            if self.moe.shared_expert_gate:
                flags.add("shared_expert_gate")
        return flags

    @classmethod
    def from_hf_config(cls, config: dict) -> "ArchSpec":
        family = family_of(config)
        if family is None:
            archs = config.get("architectures") or []
            raise ValueError(f"config.json architectures={archs} is not one of {sorted(SUPPORTED_ARCHS)}; "
                             "this model cannot be trained by the Megatron trainer")
        problems = config_problems(config)
        if problems:
            raise ValueError(problems[0])
        rope_theta = config.get("rope_theta")
        if rope_theta is None:
            rope_theta = (config.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        heads = config["num_attention_heads"]
        return cls(
            arch=family.name,
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            max_position_embeddings=config["max_position_embeddings"],
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            qkv_bias=family.attention.bias(config),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            dsa=DSAConfig.from_hf(entry) if (entry := dsa_entry(config)) is not None else None,
            moe=MoESpec.from_hf(config, family.moe) if family.moe is not None else None,
            qk_layernorm=family.attention.qk_norm(config),
            rotary_percent=family.attention.rotary_percent(config),
            mla=MLASpec.from_hf(config) if family.attention.kind == "mla" else None,
        )

    @classmethod
    def from_dir(cls, model_dir: Path) -> "ArchSpec":
        return cls.from_hf_config(json.loads((Path(model_dir) / "config.json").read_text()))

    def check_tp(self, tp: int) -> None:
        """Raise ValueError if this model cannot be split over `tp` ranks."""
        limit = self.family.max_tensor_parallel
        if limit is not None and tp > limit:
            why = " (their expert weights are not sharded)" if self.moe else ""
            raise ValueError(f"tensor_parallel={tp}: {'MoE' if self.moe else self.family.title} models "
                             f"train with tensor_parallel {limit} only{why}")
        for field, value in (
            ("num_key_value_heads", self.num_kv_heads),
            ("vocab_size", self.vocab_size),
            ("intermediate_size", self.intermediate_size),
        ):
            if value % tp:
                raise ValueError(f"{field}={value} is not divisible by tensor_parallel={tp}")

    def check_ep(self, ep: int, tp: int = 1) -> None:
        """Raise ValueError if this model's experts cannot be split over `ep` ranks."""
        if ep == 1:
            return
        if self.moe is None:
            raise ValueError(f"expert_parallel={ep}: {self.family.title} has no experts to split "
                             "(expert parallelism is for MoE models)")
        if self.moe.num_experts % ep:
            raise ValueError(f"expert_parallel={ep} does not divide the {self.moe.num_experts} experts "
                             "of each MoE layer")
        if tp > 1:
            raise ValueError(f"expert_parallel={ep} with tensor_parallel={tp}: MoE models train with "
                             "tensor_parallel 1 only")
