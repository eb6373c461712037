"""Build a Megatron-core GPTModel shaped like a Hugging Face checkpoint of a registered family
(`kiln.api.model_families`: Llama, Qwen2, Qwen3 and their MoE variants, GLM-4.5 MoE, DeepSeek-V3).

`ArchSpec.from_hf_config` (`arch.py`) reads the dimensions out of config.json; `build_gpt_model` turns them
into a TransformerConfig and a GPTModel with Megatron's local (pure PyTorch) layer spec, which
runs on CPUs and GPUs alike without transformer-engine or apex. A config.json with a `kiln_dsa`
entry gets DeepSeek sparse attention in every layer (see `dsa.py`). `causal_mask` gives the
explicit attention mask Megatron needs on CPUs; `token_logprobs` runs the model and returns
per-token log-probs of the given sequences, with the vocabulary split across tensor-parallel
ranks; `next_token_logprob` computes one such log-prob from a single logits row with the same
arithmetic, for an inference engine that must reproduce the trainer's numbers bit for bit.

A MoE family gets Megatron's MoE layers (see `moe.py`, which also holds routing record and
replay), with one layer spec per layer where its first layers are dense (DeepSeek's
`first_k_dense_replace`); Qwen3's and GLM-4.5's q/k RMSNorm per head is Megatron's
`qk_layernorm` (applied per head before RoPE, as transformers does); GLM-4.5's partial RoPE is
Megatron's `rotary_percent`; DeepSeek-V3's multi-latent attention is Megatron's MLA (`mla.py`),
and DeepSeek-V3.2's that MLA with DeepSeek sparse attention (`dsa.py`).

Weights are not loaded here (see `hf_io.py`). Not covered: sliding-window attention, RoPE
scaling, pipeline parallelism, tensor parallelism of MoE models.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from kiln.models import cpu_shims
from kiln.models import packing
from kiln.models.arch import ArchSpec
from kiln.models.dsa import apply_dsa_spec, is_dsa_model, pad_expert_rows, padded_length
from kiln.models.mla import MLASpec, patch_megatron_without_te
from kiln.models.moe import install_padded_dispatch, install_taps

AttentionBackend = Literal["sdpa", "megatron"]
DSABackend = Literal["auto", "triton", "torch"]


def _sdpa_attention_class():
    """Megatron's local core attention with the score/softmax/context part done by
    `torch.nn.functional.scaled_dot_product_attention` (causal, GQA-aware). Megatron's own
    version materialises the [b, heads, s, s] scores and masks them with an explicit mask,
    which costs ~40% of a CPU training step at sequence length 256."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class SdpaCausalAttention(DotProductAttention):
        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None):
            if packed_seq_params is not None or attention_bias is not None:
                raise ValueError("SdpaCausalAttention supports neither packed sequences nor attention bias")
            # [s, b, heads, d] -> [b, heads, s, d]; the mask is causal by construction of the
            # trainer's inputs (see causal_mask), so SDPA's built-in causal masking replaces it.
            q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))

            def attend(q, k, v):
                return F.scaled_dot_product_attention(
                    q, k, v, is_causal=True, scale=self.softmax_scale,
                    dropout_p=self.attention_dropout.p if self.training else 0.0,
                    enable_gqa=k.shape[1] != q.shape[1],
                )

            lengths = packing.segments()  # packed sequences: causal within each (packing.py)
            ctx = attend(q, k, v) if lengths is None else packing.varlen_attention(attend, q, k, v, lengths)
            # [b, heads, s, d] -> [s, b, heads * d] (d: the value head size, which MLA makes
            # narrower than the query's)
            return ctx.permute(2, 0, 1, 3).reshape(ctx.shape[2], ctx.shape[0], -1)

    return SdpaCausalAttention


def _core_attention(attention: AttentionBackend, mla: MLASpec | None):
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    base = _sdpa_attention_class() if attention == "sdpa" else DotProductAttention
    if mla is None:
        return base

    class MLACoreAttention(base):
        # Megatron-core 0.16.1's MLA passes the query and value head sizes to its core
        # attention, which only transformer-engine's accepts; the local one reads the value
        # size from kv_channels (set to v_head_dim) and the scale from softmax_scale.
        def __init__(self, *args, k_channels=None, v_channels=None, **kwargs):
            super().__init__(*args, **kwargs)

    return MLACoreAttention


def build_gpt_model(
    spec: ArchSpec,
    tp: int,
    params_dtype: torch.dtype = torch.float32,
    attention: AttentionBackend = "sdpa",
    dsa_backend: DSABackend = "auto",
    ep: int = 1,
):
    """A GPTModel of `spec`'s shape on this process's TP rank (weights uninitialised); a MoE
    model holds only its EP rank's `num_experts / ep` experts (`parallel.init_parallel(ep=...)`).

    `attention`: "sdpa" (PyTorch's fused causal attention) or "megatron" (Megatron's local
    DotProductAttention with an explicit mask), for dense models. A DSA model (`spec.dsa`) is
    built with DSA attention whatever `attention` says (it is part of the architecture, not a
    backend choice), its kernels run on `dsa_backend` (see `kiln.kernels.dsa.backend`), and its
    indexer parameters are frozen. Call `parallel.init_parallel(tp)` first.
    """
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    spec.check_tp(tp)
    spec.check_ep(ep, tp)
    if spec.mla is not None:
        patch_megatron_without_te()
    config = (MLATransformerConfig if spec.mla is not None else TransformerConfig)(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        num_attention_heads=spec.num_heads,
        num_query_groups=spec.num_kv_heads,
        # MLA: Megatron's own core attention sizes its output by kv_channels, so the value width.
        kv_channels=spec.mla.v_head_dim if spec.mla is not None else spec.head_dim,
        ffn_hidden_size=spec.intermediate_size,
        normalization="RMSNorm",
        layernorm_epsilon=spec.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=spec.qkv_bias,
        qk_layernorm=spec.qk_layernorm,
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
        **(spec.moe.transformer_config(spec.num_layers) if spec.moe is not None else {}),
        **({"expert_model_parallel_size": ep} if ep > 1 else {}),
        **(spec.mla.transformer_config() if spec.mla is not None else {}),
    )
    if attention not in ("sdpa", "megatron"):
        raise ValueError(f"attention={attention!r} is not 'sdpa' or 'megatron'")
    kinds = [spec.moe is not None and spec.moe.is_sparse(i) for i in range(spec.num_layers)]
    specs = {sparse: get_gpt_layer_local_spec(
        num_experts=spec.moe.num_experts if sparse else None, normalization="RMSNorm",
        qk_layernorm=spec.qk_layernorm,
        multi_latent_attention=spec.mla is not None) for sparse in set(kinds)}
    for layer_spec in specs.values():
        if spec.dsa is not None:
            apply_dsa_spec(layer_spec, spec.dsa, dsa_backend)
        elif attention == "sdpa" or spec.mla is not None:
            layer_spec.submodules.self_attention.submodules.core_attention = _core_attention(attention, spec.mla)
    if spec.dsa is not None:
        attention = "dsa"
    if len(specs) == 1:
        layer_spec = specs[kinds[0]]
    else:
        # Dense first layers, then MoE ones: one spec per layer.
        from megatron.core.transformer.transformer_block import LayerNormImpl, TransformerBlockSubmodules

        # The final norm Megatron picks for a single-layer spec, so both paths build the same.
        layer_spec = TransformerBlockSubmodules(layer_specs=[specs[k] for k in kinds], layer_norm=LayerNormImpl)
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
        rotary_percent=spec.rotary_percent,
        rotary_base=spec.rope_theta,
    )
    _mark_tensor_parallel_weights(model)
    if spec.moe is not None:
        install_taps(model)
        if spec.dsa is not None:
            pad_expert_rows(model)
        if ep > 1:
            install_padded_dispatch(model)
    model.kiln_expert_parallel = ep
    model.kiln_attention = attention
    return model.to(cpu_shims.compute_device())


def _mark_tensor_parallel_weights(model) -> None:
    """Tag sharded weights as Megatron's init would (`tensor_model_parallel`, `partition_dim`).

    Megatron sets these attributes only inside its weight initialisation, which is skipped
    because the weights come from a checkpoint; without them every shard looks like a replicated
    parameter, and the global gradient norm counts only rank 0's shards.
    """
    from megatron.core.tensor_parallel import (
        ColumnParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
        set_tensor_model_parallel_attributes,
    )

    for module in model.modules():
        if isinstance(module, (ColumnParallelLinear, VocabParallelEmbedding)):
            dim = 0
        elif isinstance(module, RowParallelLinear):
            dim = 1
        else:
            continue
        weight = getattr(module, "weight", None)
        if weight is not None and not getattr(weight, "tensor_model_parallel", False):
            for attr in ("tensor_model_parallel", "partition_dim", "partition_stride"):
                if hasattr(weight, attr):
                    delattr(weight, attr)
            set_tensor_model_parallel_attributes(weight, True, dim, 1)


def causal_mask(seq_len: int, device: torch.device) -> torch.Tensor:
    """Megatron's mask convention: True where attention is NOT allowed. Shape [1, 1, S, S]."""
    return torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool, device=device), diagonal=1)[None, None]


def forward_logits(model, tokens_BS: torch.Tensor) -> torch.Tensor:
    """Logits `[B, S, V / tp]` (this rank's vocabulary shard) for right-padded `tokens_BS`."""
    b, s = tokens_BS.shape
    if is_dsa_model(model):
        # Causality comes from the indexer's selection, so no mask. Pad to a multiple of
        # dsa.ROW_MULTIPLE tokens so that each row's arithmetic does not depend on the length.
        padded = padded_length(s)
        tokens = F.pad(tokens_BS, (0, padded - s), value=0)
        position_ids = torch.arange(padded, device=tokens_BS.device)[None].expand(b, padded)
        return model(tokens, position_ids, None)[:, :s]
    position_ids = torch.arange(s, device=tokens_BS.device)[None].expand(b, s)
    # SDPA masks causally itself; an explicit [S, S] mask would only cost memory at long S.
    lengths = packing.segments()
    if getattr(model, "kiln_attention", "megatron") == "sdpa":
        mask = None
    elif lengths is not None:
        mask = packing.block_causal_mask(lengths, tokens_BS.device)
    else:
        mask = causal_mask(s, tokens_BS.device)
    return model(tokens_BS, position_ids, mask)


@dataclass(frozen=True)
class ToolChoices:
    """Where a batch's tokens were drawn as choices (`kiln.trajectory.ToolChoice`): entry i is
    token `[rows[i], cols[i]]`, drawn among `ids[i]` [A] (padded by repeating its first id,
    which leaves the distribution unchanged) at `temperature[i]` (`choice_logits`)."""

    rows: torch.Tensor
    cols: torch.Tensor
    ids: torch.Tensor
    temperature: torch.Tensor

    def to(self, device: torch.device) -> "ToolChoices":
        return ToolChoices(*(t.to(device) for t in (self.rows, self.cols, self.ids, self.temperature)))

    def select(self, idx: torch.Tensor, batch: int) -> "ToolChoices":
        """The entries of rows `idx` (of `batch` rows), renumbered as `idx` orders them."""
        new = torch.full((batch,), -1, dtype=torch.long, device=self.rows.device)
        new[idx] = torch.arange(len(idx), device=self.rows.device)
        rows = new[self.rows]
        keep = rows >= 0
        return ToolChoices(rows[keep], self.cols[keep], self.ids[keep], self.temperature[keep])


def choice_logits(logits: torch.Tensor, token_ids: torch.Tensor, scale: float | torch.Tensor,
                  temperature: float) -> torch.Tensor:
    """Rows of `logits` [..., V] as a tool choice samples them (`rollout.sampling.
    toolChoiceTemperature`): `logits * scale / temperature` at `token_ids` [..., A], -inf
    elsewhere, where scale is the request's temperature over the tool choice's and temperature
    the request's. vLLM's operations in vLLM's order (rollout's `tool_choice` processor, then
    its temperature), so a log-softmax of the result agrees with what it records."""
    kept = logits.gather(-1, token_ids) * scale
    if temperature != 1.0:
        kept = kept / temperature
    return torch.full_like(logits, -math.inf).scatter(-1, token_ids, kept)


def token_logprobs(model, tokens_BS: torch.Tensor, temperature: float = 1.0,
                   choices: ToolChoices | None = None) -> torch.Tensor:
    """Per-token log-probs `[B, S]`: entry t is log p(tokens[t] | tokens[<t]); entry 0 is 0.
    With `temperature`, of softmax(logits / temperature): the distribution rollout sampled
    from, as a tempered engine records it (`EngineSettings.tempered_logprobs`).

    Uses Megatron's vocab-parallel cross entropy, so it is exact at any TP size without
    gathering the full vocabulary. Padding positions get finite values the caller masks out.
    With `choices`, the tokens drawn as tool choices get the log-probs of the distribution
    they were drawn from (`choice_logits`; one rank's full vocabulary, tensor parallelism 1).
    """
    return _sampled_logprobs(forward_logits(model, tokens_BS), tokens_BS, temperature, choices)


def token_and_topk_logprobs(model, tokens_BS: torch.Tensor, ids_BSK: torch.Tensor,
                            temperature: float = 1.0, choices: ToolChoices | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """`token_logprobs`, and from the same forward pass `[B, S, K]` log-probs of other tokens
    in each place: entry `[b, t, j]` is log p(ids[b, t, j] | tokens[b, <t]), entries of
    position 0 are 0 (dense distillation: `ids` is a teacher's top k). One rank's full
    vocabulary (tensor parallelism 1)."""
    logits_BSV = forward_logits(model, tokens_BS)
    topk = torch.log_softmax(_tempered(logits_BSV[:, :-1].float(), temperature), dim=-1).gather(-1, ids_BSK[:, 1:])
    return (_sampled_logprobs(logits_BSV, tokens_BS, temperature, choices),
            F.pad(topk, (0, 0, 1, 0), value=0.0))


def _tempered(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    # The same float32 division a tempered engine applies to its row, so the bits agree.
    return logits if temperature == 1.0 else logits / temperature


def _sampled_logprobs(logits_BSV: torch.Tensor, tokens_BS: torch.Tensor, temperature: float = 1.0,
                      choices: ToolChoices | None = None) -> torch.Tensor:
    from megatron.core import tensor_parallel

    targets_BS = tokens_BS[:, 1:]
    # The tool choices' rows first: vocab_parallel_cross_entropy works on its input in place,
    # and with one row (B = 1) the transposed logits below are `logits_BSV`'s own storage.
    chosen = None
    if choices is not None and len(choices.rows):
        b, t = choices.rows, choices.cols
        rows_NV = choice_logits(logits_BSV[b, t - 1].float(), choices.ids,
                                temperature / choices.temperature[:, None], temperature)
        chosen = torch.log_softmax(rows_NV, dim=-1).gather(-1, tokens_BS[b, t, None])[:, 0]
    # vocab_parallel_cross_entropy takes [S, B, V] / [S, B] and returns -log p, [S, B].
    logits_SBV = _tempered(logits_BSV[:, :-1].transpose(0, 1).float(), temperature)
    nll_SB = tensor_parallel.vocab_parallel_cross_entropy(
        logits_SBV.contiguous(), targets_BS.transpose(0, 1).contiguous()
    )
    logp_BS = F.pad(-nll_SB.transpose(0, 1), (1, 0), value=0.0)
    if chosen is None:
        return logp_BS
    return logp_BS.index_put((b, t), chosen)


def next_token_logprob(logits_V: torch.Tensor, token: int) -> float:
    """log p(token) from one row of logits (this rank's vocabulary shard), computed exactly as
    `token_logprobs` computes each entry (Megatron's vocab-parallel cross entropy, row by row),
    so an engine that samples from that row records the trainer's bits."""
    from megatron.core import tensor_parallel

    target = torch.tensor([[token]], dtype=torch.long, device=logits_V.device)
    # A copy: Megatron's cross entropy subtracts the row maximum in place.
    row = logits_V.float().reshape(1, 1, -1).clone()
    nll = tensor_parallel.vocab_parallel_cross_entropy(row, target)
    return float(-nll[0, 0])
