"""DeepSeek sparse attention (DSA) inside a Megatron-core GPTModel, shared by trainer and rollout.

A checkpoint opts in with a `kiln_dsa` entry in its config.json:

    "kiln_dsa": {"index_topk": 16, "index_heads": 2, "index_dim": 16}

Every layer's self-attention then becomes `DSASelfAttention`: Megatron's own fused QKV
projection, RoPE and output projection, with a lightning indexer beside them and
`kiln.kernels.dsa` in place of dense attention:

    q_I = hidden @ wq  [tokens, index_heads, index_dim]    k_I = hidden @ wk  [tokens, index_dim]
    w   = hidden @ weights_proj  [tokens, index_heads]
    I[t, s] = sum_h w[t, h] * relu(q_I[t, h] . k_I[s])   (s <= t)
    each query attends to the index_topk keys of highest I (deterministic top-k, ties to the
    lower index), through `sparse_attention` (differentiable in q, k, v).

DeepSeek-V3.2's shape (`DeepseekV32ForCausalLM`, config.json `index_topk`, `index_n_heads`,
`index_head_dim`) is the same indexer beside Megatron's multi-latent attention
(`DSAMLASelfAttention`): MLA's per-head [nope | rope] queries and keys go through
`sparse_attention`, its narrower values zero-padded to the key width. Its MoE experts pad their
tokens to ROW_MULTIPLE rows (`pad_expert_rows`), for the same bit reproducibility.

The indexer has no positional encoding (RoPE applies to the attention's q and k only) and is
frozen: its parameters have `requires_grad=False` (the trainer's optimizer takes only trainable
parameters) and it runs under no_grad. Its weights live in the Hugging Face checkpoint as
`model.layers.N.self_attn.indexer.{wq,wk,weights_proj}.weight` ([index_heads * index_dim,
hidden], [index_dim, hidden], [index_heads, hidden]) and are replicated on every tensor-parallel
rank, so all ranks select the same keys.

`record_indices` collects each layer's selected indices during a forward pass; `index_hashes`
turns them into one hash per (sequence, layer) over the rows that predict a next token, which
the rollout engine attaches to a generation and the trainer recomputes to detect a mismatch.
`make_tiny_dsa_checkpoint` writes a random tiny DSA model for tests and `kiln consistency --dsa`.

Not covered: training the indexer (DeepSeek's dense-warm-up KL loss), an indexer key cache for
incremental decoding, context parallelism, packed sequences and Megatron's inference contexts.
"""
from __future__ import annotations

import contextlib
import functools
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from kiln.kernels.dsa import index_hash, indexer_scores, sparse_attention, topk_indices

HF_INDEXER_WEIGHTS = ("wq", "wk", "weights_proj")
"""Indexer weight names after `model.layers.N.self_attn.indexer.` (HF) and
`decoder.layers.N.self_attention.indexer.` (Megatron), each with `.weight`."""

ROW_MULTIPLE = 16
"""DSA forward passes pad the sequence (on the right, where causality makes it harmless) to a
multiple of this many tokens. CPU BLAS (MKL) routes matrix products with very few rows (here
M < 12, except 4 and 8) to other kernels that round differently, so a one-sequence rollout step
over a short prompt would not reproduce the trainer's bits; with at least 16 rows every row of a
product comes out the same whatever the number of rows."""


@dataclass(frozen=True)
class DSAConfig:
    """The `kiln_dsa` entry of config.json."""

    index_topk: int
    index_heads: int
    index_dim: int

    @classmethod
    def from_hf(cls, entry: dict) -> "DSAConfig":
        if not isinstance(entry, dict):
            raise ValueError(f"config.json kiln_dsa must be an object, got {entry!r}")
        fields = ("index_topk", "index_heads", "index_dim")
        unknown = sorted(set(entry) - set(fields))
        missing = [f for f in fields if f not in entry]
        if unknown or missing:
            raise ValueError(f"config.json kiln_dsa: unknown keys {unknown}, missing keys {missing}")
        for f in fields:
            if not isinstance(entry[f], int) or isinstance(entry[f], bool) or entry[f] < 1:
                raise ValueError(f"config.json kiln_dsa.{f}={entry[f]!r} must be a positive integer")
        return cls(**{f: entry[f] for f in fields})

    def to_hf(self) -> dict:
        return {"index_topk": self.index_topk, "index_heads": self.index_heads, "index_dim": self.index_dim}

    def weight_shapes(self, hidden_size: int) -> dict[str, tuple[int, int]]:
        """HF/Megatron indexer weight name (without `.weight`) -> shape."""
        return {
            "wq": (self.index_heads * self.index_dim, hidden_size),
            "wk": (self.index_dim, hidden_size),
            "weights_proj": (self.index_heads, hidden_size),
        }


class LightningIndexer(torch.nn.Module):
    """The indexer's three projections; replicated (not split) across tensor-parallel ranks."""

    def __init__(self, hidden_size: int, dsa: DSAConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.dsa = dsa
        for name, (out_f, in_f) in dsa.weight_shapes(hidden_size).items():
            setattr(self, name, torch.nn.Linear(in_f, out_f, bias=False, dtype=dtype))
        for p in self.parameters():
            p.requires_grad_(False)

    @torch.no_grad()
    def select(self, hidden_SBH: torch.Tensor, backend: str) -> torch.Tensor:
        """Top-k key indices [batch, tokens, index_topk] (int64, -1 = unused) for hidden states
        in Megatron's [tokens, batch, hidden] layout."""
        s, b, _ = hidden_SBH.shape
        d = self.dsa
        # Every product sees a contiguous [tokens * batch, hidden] input: strided inputs take
        # another BLAS path with other rounding.
        x = hidden_SBH.contiguous()
        q = self.wq(x).view(s, b, d.index_heads, d.index_dim).transpose(0, 1).contiguous()
        k = self.wk(x).transpose(0, 1).contiguous()
        w = self.weights_proj(x).transpose(0, 1).contiguous()
        scores = indexer_scores(q, k, w, offset=0, backend=backend)
        return topk_indices(scores, d.index_topk, backend=backend)


class _SelectsKeys:
    """What DSA's attention layers (plain and MLA) share: a lightning indexer that chooses each
    query's keys, handed to the layer's core attention for one forward pass. Mixed in before
    Megatron's attention class, whose forward it wraps."""

    def _add_indexer(self, config, dsa: DSAConfig, backend: str) -> None:
        self.indexer = LightningIndexer(config.hidden_size, dsa, config.params_dtype)
        self.dsa_backend = backend
        self.core_attention.backend = backend
        self.recorder: dict[int, torch.Tensor] | None = None

    def forward(self, hidden_states, attention_mask, *args, inference_context=None, **kwargs):
        if inference_context is not None or kwargs.get("inference_params") is not None:
            raise ValueError("DSA attention does not support Megatron inference contexts; "
                             "run full forward passes")
        indices = self.indexer.select(hidden_states, self.dsa_backend)
        if self.recorder is not None:
            self.recorder[self.layer_number] = indices
        self.core_attention.indices = indices
        try:
            return super().forward(hidden_states, attention_mask, *args, **kwargs)
        finally:
            self.core_attention.indices = None


@functools.cache
def _attention_classes():
    """DSASelfAttention and DSACoreAttention, built once on first use (Megatron imports are heavy)."""
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class DSACoreAttention(DotProductAttention):
        """Sparse attention over the indices its parent `DSASelfAttention` selected for this call."""

        backend = "auto"

        def _indices(self, packed_seq_params, attention_bias):
            """The keys its parent selected for this call; refuses what it cannot attend."""
            if packed_seq_params is not None or attention_bias is not None:
                raise ValueError("DSA attention supports neither packed sequences nor attention bias")
            indices = getattr(self, "indices", None)
            if indices is None:
                raise RuntimeError(f"{type(self).__name__} called without indices (only its parent "
                                   "self-attention, which selects them, may call it)")
            return indices

        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None):
            indices = self._indices(packed_seq_params, attention_bias)
            # [s, b, heads, d] -> [b, s, heads, d]; causality comes from the indexer's selection.
            q, k, v = (x.transpose(0, 1).contiguous() for x in (query, key, value))
            ctx = sparse_attention(q, k, v, indices, scale=self.softmax_scale, backend=self.backend)
            # [b, s, heads, d] -> [s, b, heads * d], contiguous for the output projection.
            return ctx.transpose(0, 1).reshape(ctx.shape[1], ctx.shape[0], self.hidden_size_per_partition).contiguous()

    class DSASelfAttention(_SelectsKeys, SelfAttention):
        """Megatron's SelfAttention with a lightning indexer choosing each query's keys."""

        def __init__(self, config, submodules, layer_number, attn_mask_type=None, cp_comm_type=None,
                     pg_collection=None, *, dsa: DSAConfig, backend: str = "auto"):
            super().__init__(config, submodules, layer_number, attn_mask_type=attn_mask_type,
                             cp_comm_type=cp_comm_type, pg_collection=pg_collection)
            self._add_indexer(config, dsa, backend)

    return DSASelfAttention, DSACoreAttention


@functools.cache
def _mla_attention_classes():
    """DSAMLASelfAttention and DSAMLACoreAttention: DeepSeek-V3.2's shape, multi-latent attention
    whose keys the lightning indexer selects (the indexer reads the layer's normed hidden state,
    as in `DSASelfAttention`)."""
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    _, dense_core = _attention_classes()

    class DSAMLACoreAttention(dense_core):
        """Sparse attention over MLA's per-head [nope | rope] queries and keys. Its values are
        narrower (`v_head_dim`): they are zero-padded to the key width for the kernel, which
        needs one head size, and the padding columns of the output dropped."""

        def __init__(self, *args, k_channels=None, v_channels=None, **kwargs):
            # Megatron's MLA passes these for transformer-engine's core attention only; the
            # output width comes from kv_channels (= v_head_dim), the scale from softmax_scale.
            super().__init__(*args, **kwargs)

        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None):
            indices = self._indices(packed_seq_params, attention_bias)
            v_dim = value.shape[-1]
            value = torch.nn.functional.pad(value, (0, key.shape[-1] - v_dim))
            q, k, v = (x.transpose(0, 1).contiguous() for x in (query, key, value))
            ctx = sparse_attention(q, k, v, indices, scale=self.softmax_scale, backend=self.backend)
            # [b, s, heads, key width] -> [s, b, heads * v_head_dim]
            b, s = ctx.shape[:2]
            return ctx[..., :v_dim].transpose(0, 1).reshape(s, b, -1).contiguous()

    class DSAMLASelfAttention(_SelectsKeys, MLASelfAttention):
        def __init__(self, config, submodules, layer_number, attn_mask_type=None, cp_comm_type=None,
                     pg_collection=None, *, dsa: DSAConfig, backend: str = "auto"):
            super().__init__(config, submodules, layer_number, cp_comm_type=cp_comm_type,
                             pg_collection=pg_collection)
            self._add_indexer(config, dsa, backend)

    return DSAMLASelfAttention, DSAMLACoreAttention


def apply_dsa_spec(layer_spec, dsa: DSAConfig, backend: str = "auto") -> None:
    """Turn a local GPT layer spec's self-attention (grouped-query or multi-latent) into DSA
    (in place)."""
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"dsa backend={backend!r} is not 'auto', 'triton' or 'torch'")
    attn = layer_spec.submodules.self_attention
    mla = isinstance(attn.module, type) and issubclass(attn.module, MLASelfAttention)
    self_attn, core = _mla_attention_classes() if mla else _attention_classes()
    attn.module = self_attn
    attn.params = {**attn.params, "dsa": dsa, "backend": backend}
    attn.submodules.core_attention = core


def pad_expert_rows(model: torch.nn.Module) -> None:
    """Make every expert of a DSA model's MoE layers (Megatron's SequentialMLP) run on its tokens
    padded with zero rows to a multiple of ROW_MULTIPLE, then drop the padding. How many tokens
    an expert gets depends on the whole batch, and BLAS rounds a product with few rows
    differently (see ROW_MULTIPLE): unpadded, a one-sequence rollout step would not reproduce the
    trainer's bits in the MoE layers. Called once, when the model is built."""
    from megatron.core.transformer.moe.experts import SequentialMLP

    for module in model.modules():
        if isinstance(module, SequentialMLP):
            for expert in module.local_experts:
                expert.__class__ = _padded_expert_class(type(expert))


@functools.cache
def _padded_expert_class(base: type) -> type:
    class PaddedRowsExpert(base):
        def forward(self, hidden_states, per_token_scale=None, *args, **kwargs):
            n = hidden_states.shape[0]
            pad = padded_length(max(n, 1)) - n
            if pad:
                hidden_states = torch.nn.functional.pad(hidden_states, (0, 0, 0, pad))
                if per_token_scale is not None:
                    per_token_scale = torch.nn.functional.pad(per_token_scale, (0, pad))
            out, bias = super().forward(hidden_states, per_token_scale, *args, **kwargs)
            return out[:n], bias

    return PaddedRowsExpert


def is_dsa_model(model: torch.nn.Module) -> bool:
    return getattr(model, "kiln_attention", None) == "dsa"


def dsa_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's DSA attention modules, in layer order."""
    layers = [m for m in model.modules() if isinstance(getattr(m, "indexer", None), LightningIndexer)]
    return sorted(layers, key=lambda m: m.layer_number)


def set_backend(model: torch.nn.Module, backend: str) -> None:
    """Run the model's DSA kernels on `backend` ("auto", "triton" or "torch") from now on."""
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"dsa backend={backend!r} is not 'auto', 'triton' or 'torch'")
    for m in dsa_layers(model):
        m.dsa_backend = backend
        m.core_attention.backend = backend


def indexer_parameters(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """(name, parameter) of every indexer weight (frozen)."""
    return [(n, p) for n, p in model.named_parameters() if ".indexer." in n]


@contextlib.contextmanager
def record_indices(model: torch.nn.Module) -> Iterator[dict[int, torch.Tensor]]:
    """Within the block, every forward pass stores each DSA layer's selected indices
    [batch, tokens, index_topk] in the yielded dict, keyed by layer number (1-based, Megatron's)
    and overwritten by the next pass. Empty for a dense model."""
    layers = dsa_layers(model)
    store: dict[int, torch.Tensor] = {}
    for m in layers:
        m.recorder = store
    try:
        yield store
    finally:
        for m in layers:
            m.recorder = None


def padded_length(seq_len: int) -> int:
    return -(-seq_len // ROW_MULTIPLE) * ROW_MULTIPLE


def sequence_hashes(indices: dict[int, torch.Tensor], row: int, length: int) -> list[int]:
    """One hash per layer (in layer order) of sequence `row`'s selected indices over the rows
    that predict a next token: positions 0 .. length - 2 of a sequence of `length` tokens."""
    return [index_hash(indices[layer][row : row + 1, : max(length - 1, 0)]) for layer in sorted(indices)]


def count_mismatches(a: list[list[int]], b: list[list[int]]) -> int:
    """Number of (sequence, layer) hashes that differ between two `index_hashes` results."""
    if len(a) != len(b) or any(len(x) != len(y) for x, y in zip(a, b)):
        raise ValueError(f"index hash lists differ in shape: {[len(x) for x in a]} vs {[len(y) for y in b]}")
    return sum(x != y for xs, ys in zip(a, b) for x, y in zip(xs, ys))


def make_tiny_dsa_checkpoint(
    out_dir: Path, *, index_topk: int = 16, index_heads: int = 2, index_dim: int = 16, seed: int = 0,
    **model_kwargs,
) -> Path:
    """A tiny random checkpoint (tokenizer included, see `tiny_model.make_tiny_checkpoint`) with a
    `kiln_dsa` config entry and random indexer weights. The same arguments give the same bits."""
    from kiln.models.tiny import make_tiny_checkpoint

    out_dir = make_tiny_checkpoint(out_dir, seed=seed, **model_kwargs)
    dsa = DSAConfig(index_topk, index_heads, index_dim)
    cfg_path = out_dir / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["kiln_dsa"] = dsa.to_hf()
    cfg_path.write_text(json.dumps(cfg, indent=2))
    add_random_indexer(out_dir, dsa, seed)
    return out_dir


def to_tiny_deepseek_v32(out_dir: Path, dsa: DSAConfig, seed: int) -> Path:
    """Turn the tiny DeepSeek-V3 checkpoint in `out_dir` into DeepSeek-V3.2's shape: config.json
    renamed (architectures DeepseekV32ForCausalLM, model_type deepseek_v32) with `dsa` as its
    `index_topk`, `index_n_heads` and `index_head_dim`, and random indexer weights. config.json is
    written here, not by transformers' V3.2 config class, whose indexer is not Kiln's."""
    cfg_path = Path(out_dir) / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.update(architectures=["DeepseekV32ForCausalLM"], model_type="deepseek_v32", index_topk=dsa.index_topk,
               index_n_heads=dsa.index_heads, index_head_dim=dsa.index_dim)
    cfg_path.write_text(json.dumps(cfg, indent=2))
    add_random_indexer(Path(out_dir), dsa, seed)
    return Path(out_dir)


def add_random_indexer(out_dir: Path, dsa: DSAConfig, seed: int) -> None:
    """Add random indexer weights of `dsa`'s shape to every layer of the checkpoint in `out_dir`
    (one model.safetensors file)."""
    from safetensors.torch import load_file, save_file

    cfg = json.loads((out_dir / "config.json").read_text())
    weights_path = out_dir / "model.safetensors"
    tensors = load_file(str(weights_path))
    dtype = tensors["model.embed_tokens.weight"].dtype
    gen = torch.Generator().manual_seed(seed + 1)
    hidden = cfg["hidden_size"]
    for i in range(cfg["num_hidden_layers"]):
        for name, shape in dsa.weight_shapes(hidden).items():
            w = torch.randn(shape, generator=gen) / hidden**0.5
            tensors[f"model.layers.{i}.self_attn.indexer.{name}.weight"] = w.to(dtype)
    save_file(tensors, str(weights_path), metadata={"format": "pt"})
