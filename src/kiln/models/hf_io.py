"""Hugging Face <-> Megatron-core weight mapping for Llama and Qwen2, with tensor parallelism.

Megatron-core ships no converter, so the layout rules live here:
- attention: Megatron fuses Q, K and V into one `linear_qkv` whose rows are grouped per KV head:
  for each of the `num_kv_heads` groups, that group's `heads_per_group` query heads, then its key
  head, then its value head (Qwen2's q/k/v biases follow the same order). Tensor parallelism
  splits the fused rows into `tp` contiguous blocks, i.e. whole KV groups per rank;
- MLP: `linear_fc1` is `cat[gate, up]` per rank (each rank's gate shard then its up shard),
  because Megatron's gated MLP splits its local fc1 output in two halves;
- column-parallel weights (embedding, qkv, fc1, lm head) split along rows, row-parallel ones
  (attention output, fc2) along columns; norms are replicated;
- DSA models (config.json `kiln_dsa`): the lightning indexer's weights
  `model.layers.N.self_attn.indexer.{wq,wk,weights_proj}.weight` map one to one onto
  `decoder.layers.N.self_attention.indexer.*` and are replicated on every rank.

`load_hf_checkpoint` fills a GPTModel from a checkpoint directory; `iter_hf_tensors` yields
`(hf_name, tensor)` for the full (unsharded) model on every TP rank (it gathers shards, so all
ranks must call it together); `save_hf_checkpoint` writes config.json + model.safetensors.

- MoE models (Qwen2-MoE): the router, each expert and the shared expert map as `moe.py` says,
  one expert at a time under the hub's per-expert names (`mlp.experts.J.gate_proj.weight`...),
  which are also the names vLLM loads; TP=1 only.

Not covered: expert parallelism, MLA, quantised checkpoints, sharded safetensors writing.
"""
from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from kiln.models import parallel
from kiln.models.dsa import HF_INDEXER_WEIGHTS
from kiln.models.moe import hf_moe_to_megatron, iter_hf_moe
from kiln.models.megatron_model import ArchSpec, AttentionBackend, DSABackend, build_gpt_model

# Megatron name (per layer, after "decoder.layers.{i}.") -> HF name (after "model.layers.{i}.")
_LAYER_NORMS = {
    "input_layernorm.weight": "input_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
}


def read_hf_state_dict(model_dir: Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint directory (single file or sharded safetensors)."""
    from safetensors.torch import load_file

    model_dir = Path(model_dir)
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model directory {model_dir} has no *.safetensors files")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(str(f)))
    return out


def _shard(t: torch.Tensor, dim: int, rank: int, tp: int) -> torch.Tensor:
    return torch.chunk(t, tp, dim=dim)[rank]


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: ArchSpec) -> torch.Tensor:
    """HF q/k/v (weights [out, in] or biases [out]) -> Megatron's grouped fused layout."""
    g, d = spec.num_kv_heads, spec.head_dim
    hpg = spec.num_heads // g
    tail = q.shape[1:]
    q = q.reshape(g, hpg * d, *tail)
    k = k.reshape(g, d, *tail)
    v = v.reshape(g, d, *tail)
    return torch.cat([q, k, v], dim=1).reshape(g * (hpg + 2) * d, *tail)


def split_qkv(fused: torch.Tensor, spec: ArchSpec) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of `fuse_qkv` (on the full, gathered tensor)."""
    g, d = spec.num_kv_heads, spec.head_dim
    hpg = spec.num_heads // g
    tail = fused.shape[1:]
    x = fused.reshape(g, (hpg + 2) * d, *tail)
    q, k, v = torch.split(x, [hpg * d, d, d], dim=1)
    return (
        q.reshape(g * hpg * d, *tail).contiguous(),
        k.reshape(g * d, *tail).contiguous(),
        v.reshape(g * d, *tail).contiguous(),
    )


def hf_to_megatron_shard(hf: dict[str, torch.Tensor], spec: ArchSpec, rank: int, tp: int) -> dict[str, torch.Tensor]:
    """The Megatron state dict of TP rank `rank` from a full HF state dict."""
    out: dict[str, torch.Tensor] = {}
    out["embedding.word_embeddings.weight"] = _shard(hf["model.embed_tokens.weight"], 0, rank, tp)
    for i in range(spec.num_layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        for mname, hname in _LAYER_NORMS.items():
            out[m + mname] = hf[h + hname]
        a = h + "self_attn."
        qkv = fuse_qkv(hf[a + "q_proj.weight"], hf[a + "k_proj.weight"], hf[a + "v_proj.weight"], spec)
        out[m + "self_attention.linear_qkv.weight"] = _shard(qkv, 0, rank, tp)
        if spec.qkv_bias:
            bias = fuse_qkv(hf[a + "q_proj.bias"], hf[a + "k_proj.bias"], hf[a + "v_proj.bias"], spec)
            out[m + "self_attention.linear_qkv.bias"] = _shard(bias, 0, rank, tp)
        out[m + "self_attention.linear_proj.weight"] = _shard(hf[a + "o_proj.weight"], 1, rank, tp)
        if spec.dsa is not None:
            for name in HF_INDEXER_WEIGHTS:
                out[m + f"self_attention.indexer.{name}.weight"] = hf[a + f"indexer.{name}.weight"]
        if spec.moe is not None:
            out.update(hf_moe_to_megatron(hf, spec.moe, h + "mlp.", m + "mlp."))
            continue
        gate = _shard(hf[h + "mlp.gate_proj.weight"], 0, rank, tp)
        up = _shard(hf[h + "mlp.up_proj.weight"], 0, rank, tp)
        out[m + "mlp.linear_fc1.weight"] = torch.cat([gate, up], dim=0)
        out[m + "mlp.linear_fc2.weight"] = _shard(hf[h + "mlp.down_proj.weight"], 1, rank, tp)
    out["decoder.final_layernorm.weight"] = hf["model.norm.weight"]
    if not spec.tie_word_embeddings:
        out["output_layer.weight"] = _shard(hf["lm_head.weight"], 0, rank, tp)
    return out


def load_state_into(model: torch.nn.Module, mstate: dict[str, torch.Tensor]) -> None:
    """Copy `mstate` into the model's parameters, checking names and shapes both ways."""
    params = dict(model.named_parameters())
    missing = sorted(set(params) - set(mstate))
    unexpected = sorted(set(mstate) - set(params))
    if missing or unexpected:
        raise ValueError(f"weight mapping mismatch: missing={missing} unexpected={unexpected}")
    with torch.no_grad():
        for name, p in params.items():
            src = mstate[name]
            if src.shape != p.shape:
                raise ValueError(f"{name}: checkpoint shape {tuple(src.shape)} != model shape {tuple(p.shape)}")
            p.copy_(src.to(p.dtype))


def load_hf_checkpoint(
    model_dir: Path,
    tp: int = 1,
    params_dtype: torch.dtype = torch.float32,
    attention: AttentionBackend = "sdpa",
    dsa_backend: DSABackend = "auto",
):
    """Build a GPTModel for this TP rank and fill it from `model_dir`. Returns (model, spec)."""
    spec = ArchSpec.from_dir(model_dir)
    model = build_gpt_model(spec, tp, params_dtype, attention, dsa_backend)
    hf = read_hf_state_dict(model_dir)
    if spec.dsa is not None:
        missing = [n for n in HF_INDEXER_WEIGHTS if f"model.layers.0.self_attn.indexer.{n}.weight" not in hf]
        if missing:
            raise ValueError(f"{model_dir}: config.json has kiln_dsa but the checkpoint lacks indexer weights "
                             f"model.layers.N.self_attn.indexer.{{{','.join(missing)}}}.weight")
    load_state_into(model, hf_to_megatron_shard(hf, spec, parallel.tp_rank(), tp))
    return model, spec


def _gather(model_params: dict[str, torch.Tensor], name: str, dim: int) -> torch.Tensor:
    return parallel.all_gather_tp(model_params[name].detach(), dim)


def _gather_fc1(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each rank holds cat[gate_r, up_r]; return the full gate and up."""
    gate_r, up_r = torch.chunk(t.detach(), 2, dim=0)
    return parallel.all_gather_tp(gate_r, 0), parallel.all_gather_tp(up_r, 0)


def iter_hf_tensors(model: torch.nn.Module, spec: ArchSpec) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(hf_name, full_tensor)` for every HF weight, layer by layer (collective at TP>1).

    Tensors are detached; at TP=1 the norms and row/column-parallel weights share storage with
    the model, so copy them before mutating.
    """
    p = dict(model.named_parameters())
    yield "model.embed_tokens.weight", _gather(p, "embedding.word_embeddings.weight", 0)
    for i in range(spec.num_layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        for mname, hname in _LAYER_NORMS.items():
            yield h + hname, p[m + mname].detach()
        a = h + "self_attn."
        q, k, v = split_qkv(_gather(p, m + "self_attention.linear_qkv.weight", 0), spec)
        yield a + "q_proj.weight", q
        yield a + "k_proj.weight", k
        yield a + "v_proj.weight", v
        if spec.qkv_bias:
            qb, kb, vb = split_qkv(_gather(p, m + "self_attention.linear_qkv.bias", 0), spec)
            yield a + "q_proj.bias", qb
            yield a + "k_proj.bias", kb
            yield a + "v_proj.bias", vb
        yield a + "o_proj.weight", _gather(p, m + "self_attention.linear_proj.weight", 1)
        if spec.dsa is not None:
            for name in HF_INDEXER_WEIGHTS:
                yield a + f"indexer.{name}.weight", p[m + f"self_attention.indexer.{name}.weight"].detach()
        if spec.moe is not None:
            yield from iter_hf_moe(p, spec.moe, h + "mlp.", m + "mlp.")
            continue
        gate, up = _gather_fc1(p[m + "mlp.linear_fc1.weight"])
        yield h + "mlp.gate_proj.weight", gate
        yield h + "mlp.up_proj.weight", up
        yield h + "mlp.down_proj.weight", _gather(p, m + "mlp.linear_fc2.weight", 1)
    yield "model.norm.weight", p["decoder.final_layernorm.weight"].detach()
    if not spec.tie_word_embeddings:
        yield "lm_head.weight", _gather(p, "output_layer.weight", 0)


def save_hf_checkpoint(
    model: torch.nn.Module,
    spec: ArchSpec,
    out_dir: Path,
    *,
    source_dir: Path,
    dtype: torch.dtype | None = None,
) -> Path | None:
    """Write the model as a HF checkpoint directory (see `write_hf_dir`). Collective at TP>1;
    only TP rank 0 writes (the others return None)."""
    tensors = iter_hf_tensors(model, spec)
    if parallel.tp_rank() != 0:
        for _ in tensors:  # take part in the gathers
            pass
        return None
    return write_hf_dir(tensors, out_dir, source_dir=source_dir, dtype=dtype)


def write_hf_dir(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    out_dir: Path,
    *,
    source_dir: Path,
    dtype: torch.dtype | None = None,
) -> Path:
    """A HF checkpoint directory: `source_dir`'s config and tokenizer files plus a
    model.safetensors of `named_tensors` (cast to `dtype` if given).

    The directory appears atomically: it is written under a temporary name, fsynced and
    renamed, replacing an existing `out_dir`.
    """
    from safetensors.torch import save_file

    tensors = {n: (t.to(dtype) if dtype else t).contiguous() for n, t in named_tensors}
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    source_dir = Path(source_dir)
    for f in source_dir.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
            shutil.copyfile(f, tmp / f.name)
    if dtype is not None:
        cfg = json.loads((tmp / "config.json").read_text())
        cfg["torch_dtype"] = cfg["dtype"] = str(dtype).removeprefix("torch.")
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    fsync_tree(tmp)
    # The old directory is moved aside before it is deleted, so readers see it whole until
    # the new one takes its name.
    old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
    if out_dir.exists():
        if old.exists():
            shutil.rmtree(old)
        os.replace(out_dir, old)
    os.replace(tmp, out_dir)
    fsync_dir(out_dir.parent)
    if old.exists():
        shutil.rmtree(old)
    return out_dir


def fsync_dir(path: Path) -> None:
    fd = os.open(str(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file under `root`, then the directories, so a rename publishes whole data."""
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            with open(os.path.join(dirpath, name), "rb") as f:
                os.fsync(f.fileno())
        fsync_dir(Path(dirpath))
