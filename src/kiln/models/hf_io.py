"""Hugging Face <-> Megatron-core weights, with tensor parallelism, driven by the family's
weight table (`kiln.api.model_families.WeightTable`).

Megatron-core ships no converter. The names live in the registry, one table per family read in
both directions; the layout rules of each row's kind live here:
- `qkv`: Megatron fuses Q, K and V into one `linear_qkv` whose rows are grouped per KV head:
  for each of the `num_kv_heads` groups, that group's `heads_per_group` query heads, then its key
  head, then its value head (q/k/v biases follow the same order). Tensor parallelism splits the
  fused rows into `tp` contiguous blocks, i.e. whole KV groups per rank;
- `gate_up`: `linear_fc1` is `cat[gate, up]` per rank (each rank's gate shard then its up shard),
  because Megatron's gated MLP splits its local fc1 output in two halves;
- `column` weights (embedding, lm head) split along rows, `row` ones (attention output, fc2)
  along columns; `copy` ones (norms, q/k norms, the router, DSA indexers) are replicated.

`load_hf_checkpoint` fills a GPTModel from a checkpoint directory; `iter_hf_tensors` streams
`(hf_name, tensor)` for the full (unsharded) model on every TP rank (it gathers shards, so all
ranks must call it together), for weight sync and export; `save_hf_checkpoint` writes
config.json + model.safetensors. MoE experts map one expert at a time under the hub's
per-expert names (`mlp.experts.J.gate_proj.weight`...), which are also the names vLLM loads;
TP=1 only. A MoE model's dense layers (`MoESpec.dense_layers`) take the dense MLP rows.

Expert parallelism: EP rank r holds experts `r*L .. r*L + L-1` (L = num_experts / ep) as its
`local_experts.0 .. L-1`; loading takes only those, and `iter_hf_tensors` broadcasts each expert
from the rank that holds it, in the weight table's order (expert 0, 1, ... as at EP=1), so weight
sync and export see the whole model in the same buckets whatever the split. Every rank of the
expert-parallel group must iterate to the end.

Not covered: quantised checkpoints, sharded safetensors writing.
"""
from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from kiln.api.model_families import family_of
from kiln.api.weight_tables import Weight, WeightTable
from kiln.models import parallel
from kiln.models.dsa import HF_INDEXER_WEIGHTS
from kiln.models.megatron_model import ArchSpec, AttentionBackend, DSABackend, build_gpt_model


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


def weight_rows(spec: ArchSpec) -> Iterator[tuple[Weight, str, tuple[str, ...]]]:
    """Every row of the model's weight table with its full names: `(row, megatron name, hf
    names)`, model-wide rows first, then layer by layer (the same order on every rank)."""
    for row, m, names, _ in expert_split_rows(spec, 1):
        yield row, m, names


def expert_split_rows(spec: ArchSpec, ep: int) -> Iterator[tuple[Weight, str, tuple[str, ...], int | None]]:
    """`weight_rows` with experts split over `ep` ranks: `(row, megatron name, hf names, owner)`
    where an expert row's Megatron name holds its index among its owner's local experts and
    `owner` is that EP rank (None for the rows every rank holds)."""
    table, flags = spec.family.weights, spec.weight_flags()
    local = spec.moe.num_experts // ep if spec.moe is not None else 0

    def named(row: Weight, m: str, h: str, e: int | None = None):
        if e is None:
            return row, m + row.megatron, tuple(h + n for n in row.hf), None
        return (row, m + row.megatron.format(e=e % local), tuple(h + n.format(e=e) for n in row.hf),
                e // local)

    for row in WeightTable.rows(table.model, flags):
        yield named(row, "", "")
    for i in range(spec.num_layers):
        m, h = f"decoder.layers.{i}.", f"model.layers.{i}."
        for row in WeightTable.rows(table.layer, flags):
            yield named(row, m, h)
        if spec.moe is None or not spec.moe.is_sparse(i):
            for row in WeightTable.rows(table.dense_mlp, flags):
                yield named(row, m, h)
            continue
        for row in WeightTable.rows(table.moe, flags):
            yield named(row, m, h)
        for e in range(spec.moe.num_experts):
            for row in WeightTable.rows(table.expert, flags):
                yield named(row, m, h, e)


def _to_megatron(row: Weight, ts: list[torch.Tensor], spec: ArchSpec, rank: int, tp: int) -> torch.Tensor:
    if row.kind == "copy":
        return ts[0]
    if row.kind in ("column", "row"):
        return _shard(ts[0], 0 if row.kind == "column" else 1, rank, tp)
    if row.kind == "qkv":
        return _shard(fuse_qkv(*ts, spec), 0, rank, tp)
    if row.kind == "gate_up":
        return torch.cat([_shard(t, 0, rank, tp) for t in ts], dim=0)
    raise ValueError(f"weight kind {row.kind!r} is unknown")


def hf_to_megatron_shard(hf: dict[str, torch.Tensor], spec: ArchSpec, rank: int, tp: int,
                         ep_rank: int = 0, ep: int = 1) -> dict[str, torch.Tensor]:
    """The Megatron state dict of TP rank `rank` (and EP rank `ep_rank` of `ep`: its experts
    only) from a full HF state dict (KeyError naming the first HF tensor it lacks)."""
    return {m: _to_megatron(row, [hf[n] for n in names], spec, rank, tp)
            for row, m, names, owner in expert_split_rows(spec, ep) if owner in (None, ep_rank)}


def model_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's weights as the weight tables name them: its parameters, and the buffers that
    hold checkpoint data (a router's `expert_bias`, the selection bias of sigmoid routing)."""
    out = dict(model.named_parameters())
    out.update((n, b) for n, b in model.named_buffers() if n.endswith("router.expert_bias"))
    return out


def load_state_into(model: torch.nn.Module, mstate: dict[str, torch.Tensor]) -> None:
    """Copy `mstate` into the model's weights (`model_tensors`), checking names and shapes both
    ways."""
    params = model_tensors(model)
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
    ep: int = 1,
):
    """Build a GPTModel for this TP rank (and EP rank, its experts only) and fill it from
    `model_dir`. Returns (model, spec)."""
    spec = ArchSpec.from_dir(model_dir)
    model = build_gpt_model(spec, tp, params_dtype, attention, dsa_backend, ep=ep)
    hf = read_hf_state_dict(model_dir)
    if spec.dsa is not None:
        missing = [n for n in HF_INDEXER_WEIGHTS if f"model.layers.0.self_attn.indexer.{n}.weight" not in hf]
        if missing:
            raise ValueError(f"{model_dir}: config.json has DeepSeek sparse attention (kiln_dsa or index_* fields) "
                             "but the checkpoint lacks Kiln's indexer weights "
                             f"model.layers.N.self_attn.indexer.{{{','.join(missing)}}}.weight")
    load_state_into(model, hf_to_megatron_shard(hf, spec, parallel.tp_rank(), tp,
                                                parallel.ep_rank() if ep > 1 else 0, ep))
    return model, spec


def _from_megatron(row: Weight, p: torch.Tensor, spec: ArchSpec) -> tuple[torch.Tensor, ...]:
    p = p.detach()
    if row.kind == "copy":
        return (p,)
    if row.kind in ("column", "row"):
        return (parallel.all_gather_tp(p, 0 if row.kind == "column" else 1),)
    if row.kind == "qkv":
        return split_qkv(parallel.all_gather_tp(p, 0), spec)
    if row.kind == "gate_up":
        # Each rank holds cat[gate_r, up_r].
        return tuple(parallel.all_gather_tp(half, 0) for half in torch.chunk(p, 2, dim=0))
    raise ValueError(f"weight kind {row.kind!r} is unknown")


def iter_hf_tensors(model: torch.nn.Module, spec: ArchSpec) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(hf_name, full_tensor)` for every HF weight, row by row of the weight table
    (collective at TP>1 and with expert parallelism: every rank must iterate to the end).

    Tensors are detached and may share storage with the model (at TP=1 most do), so copy them
    before mutating.
    """
    params = model_tensors(model)
    ep = getattr(model, "kiln_expert_parallel", 1)
    mine = parallel.ep_rank() if ep > 1 else 0
    for row, m, names, owner in expert_split_rows(spec, ep):
        p = params[m]
        if owner is not None and ep > 1:
            # The owner's expert, to every rank of the group (the same shape on all: every
            # rank's local experts are alike).
            p = p.detach() if owner == mine else torch.empty_like(p)
            dist.broadcast(p, src=parallel.ep_global_rank(owner), group=parallel.ep_group())
        yield from zip(names, _from_megatron(row, p, spec))


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
    model.safetensors of `named_tensors` (cast to `dtype` if given, except the tensors its
    family's weight table keeps in float32).

    The directory appears atomically: it is written under a temporary name, fsynced and
    renamed, replacing an existing `out_dir`.
    """
    from safetensors.torch import save_file

    keep = _float32_suffixes(Path(source_dir)) if dtype is not None else set()
    tensors = {n: (t.to(dtype) if dtype and not n.endswith(tuple(keep)) else t).contiguous()
               for n, t in named_tensors}
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


def _float32_suffixes(source_dir: Path) -> set[str]:
    config = source_dir / "config.json"
    family = family_of(json.loads(config.read_text())) if config.exists() else None
    return {"." + n for n in family.weights.float32_suffixes()} if family is not None else set()


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
