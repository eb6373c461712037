"""Build a Megatron-core GPTModel shaped like a Hugging Face Llama or Qwen2 checkpoint.

`ArchSpec.from_hf_config` reads the dimensions out of config.json; `build_gpt_model` turns them
into a TransformerConfig and a GPTModel with Megatron's local (pure PyTorch) layer spec, which
runs on CPUs and GPUs alike without transformer-engine or apex. `causal_mask` gives the explicit
attention mask Megatron needs on CPUs; `token_logprobs` runs the model and returns per-token
log-probs of the given sequences, with the vocabulary split across tensor-parallel ranks.

Weights are not loaded here (see `hf_io.py`). Not covered: MoE, MLA, sliding-window attention,
RoPE scaling, pipeline parallelism.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from kiln.services.trainer import cpu_shims

SUPPORTED_ARCHS = {"Qwen2ForCausalLM": "qwen2", "LlamaForCausalLM": "llama"}


@dataclass(frozen=True)
class ArchSpec:
    """The parts of a HF config that decide the Megatron model's shape."""

    arch: str
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

    @classmethod
    def from_hf_config(cls, config: dict) -> "ArchSpec":
        archs = config.get("architectures") or []
        known = [a for a in archs if a in SUPPORTED_ARCHS]
        if not known:
            raise ValueError(
                f"config.json architectures={archs} is not one of {sorted(SUPPORTED_ARCHS)}; "
                "this model cannot be trained by the Megatron trainer"
            )
        arch = SUPPORTED_ARCHS[known[0]]
        if config.get("hidden_act", "silu") != "silu":
            raise ValueError(f"config.json hidden_act={config['hidden_act']!r}: only 'silu' is supported")
        rope_scaling = config.get("rope_scaling")
        if rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type")) not in (None, "default"):
            raise ValueError(f"config.json rope_scaling={rope_scaling}: RoPE scaling is not supported")
        rope_theta = config.get("rope_theta")
        if rope_theta is None:
            rope_theta = (config.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        heads = config["num_attention_heads"]
        if arch == "qwen2":
            qkv_bias = True
        else:
            qkv_bias = bool(config.get("attention_bias", False))
            if config.get("mlp_bias"):
                raise ValueError("config.json mlp_bias=true is not supported")
        return cls(
            arch=arch,
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
            qkv_bias=qkv_bias,
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        )

    @classmethod
    def from_dir(cls, model_dir: Path) -> "ArchSpec":
        return cls.from_hf_config(json.loads((Path(model_dir) / "config.json").read_text()))

    def check_tp(self, tp: int) -> None:
        """Raise ValueError if this model cannot be split over `tp` ranks."""
        for field, value in (
            ("num_key_value_heads", self.num_kv_heads),
            ("vocab_size", self.vocab_size),
            ("intermediate_size", self.intermediate_size),
        ):
            if value % tp:
                raise ValueError(f"{field}={value} is not divisible by tensor_parallel={tp}")


def build_gpt_model(spec: ArchSpec, tp: int, params_dtype: torch.dtype = torch.float32):
    """A GPTModel of `spec`'s shape on this process's TP rank (weights uninitialised).

    Call `parallel.init_parallel(tp)` first.
    """
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    spec.check_tp(tp)
    config = TransformerConfig(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        num_attention_heads=spec.num_heads,
        num_query_groups=spec.num_kv_heads,
        kv_channels=spec.head_dim,
        ffn_hidden_size=spec.intermediate_size,
        normalization="RMSNorm",
        layernorm_epsilon=spec.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=spec.qkv_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        sequence_parallel=False,
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        use_cpu_initialization=cpu_shims.cpu_only(),
        # Weights come from a checkpoint; skipping Megatron's init also skips its RNG use.
        perform_initialization=False,
        # The fused kernels need CUDA (and apex/TE); the plain paths give the same numbers.
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        attention_softmax_in_fp32=True,
    )
    layer_spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec,
        vocab_size=spec.vocab_size,
        max_sequence_length=spec.max_position_embeddings,
        pre_process=True,
        post_process=True,
        parallel_output=True,
        share_embeddings_and_output_weights=spec.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_percent=1.0,
        rotary_base=spec.rope_theta,
    )
    return model.to(cpu_shims.compute_device())


def causal_mask(seq_len: int, device: torch.device) -> torch.Tensor:
    """Megatron's mask convention: True where attention is NOT allowed. Shape [1, 1, S, S]."""
    return torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool, device=device), diagonal=1)[None, None]


def forward_logits(model, tokens_BS: torch.Tensor) -> torch.Tensor:
    """Logits `[B, S, V / tp]` (this rank's vocabulary shard) for right-padded `tokens_BS`."""
    b, s = tokens_BS.shape
    position_ids = torch.arange(s, device=tokens_BS.device)[None].expand(b, s)
    return model(tokens_BS, position_ids, causal_mask(s, tokens_BS.device))


def token_logprobs(model, tokens_BS: torch.Tensor) -> torch.Tensor:
    """Per-token log-probs `[B, S]`: entry t is log p(tokens[t] | tokens[<t]); entry 0 is 0.

    Uses Megatron's vocab-parallel cross entropy, so it is exact at any TP size without
    gathering the full vocabulary. Padding positions get finite values the caller masks out.
    """
    from megatron.core import tensor_parallel

    logits_BSV = forward_logits(model, tokens_BS)
    targets_BS = tokens_BS[:, 1:]
    # vocab_parallel_cross_entropy takes [S, B, V] / [S, B] and returns -log p, [S, B].
    nll_SB = tensor_parallel.vocab_parallel_cross_entropy(
        logits_BSV[:, :-1].transpose(0, 1).float().contiguous(), targets_BS.transpose(0, 1).contiguous()
    )
    logp_BS = -nll_SB.transpose(0, 1)
    return F.pad(logp_BS, (1, 0), value=0.0)
