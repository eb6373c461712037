"""LoRA adapters on the trainer's Megatron linear layers, tensor-parallel, and their PEFT form.

`attach(model, spec, lora, seed)` freezes every weight of a GPTModel and gives each targeted
linear layer an adapter (`Adapter`, the submodule `<layer>.lora`), whose output
`(alpha / r) * B @ A @ dropout(x)` a forward hook adds to the layer's. A starts as PEFT starts
it (Kaiming-uniform, drawn from a generator seeded by the seed and the layer's name, so every
tensor-parallel size draws the same A) and B at zero, so a fresh adapter leaves the model's
outputs unchanged.

Tensor parallelism, with one collective per adapter and none in the forward of a column layer:
- ColumnParallelLinear (`linear_qkv`, `linear_fc1`; input replicated, output split on rows):
  A [r, in] replicated, B [out / tp, r] split as the weight's rows. The intermediate `A @ x`
  goes through Megatron's copy-to-region (identity forward, all-reduce backward), so A's
  gradient and the input's gradient sum the contributions of every rank's rows of B;
- RowParallelLinear (`linear_proj`, `linear_fc2`; input split on columns, output all-reduced):
  A [r, in / tp] split as the weight's columns, B [out, r] replicated. The partial `A_local @
  x_local` is all-reduced (reduce-from-region: all-reduce forward, identity backward), after
  which every rank computes the same full `B @ h`.

PEFT names the projections (q_proj, ..., down_proj); the trainer fuses q/k/v into `linear_qkv`
and gate/up into `linear_fc1`. A fused layer targeted for a subset of its projections gets one
adapter whose B rows of the projections not targeted are held at zero by a fixed mask; each
targeted projection is then exactly a PEFT adapter with the shared A and its rows of B
(`adapter_hf_tensors`, which gathers the shards: collective at TP > 1).

A policy version carries that adapter and `weights_digest` of the frozen base
(`version_tensors`; the names, in `lora_names`, are what the weight-sync service tells an adapter
version by, without torch). `merge_adapter(base, adapter, scaling)` is the rollout's side: full HF-named
weights with `W + scaling * B @ A` for every adapted projection, computed from the pristine
`base` each time so that versions never accumulate; `merged_hf_tensors` is the trainer's
(exports of whole models); `write_peft_dir` writes PEFT's adapter files.

Not covered: MoE experts (the adapters go on attention and dense MLPs only), MLA attention.
"""
from __future__ import annotations

import math
import zlib
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from kiln.api.model import LoraSpec
from kiln.models import parallel
from kiln.models.arch import ArchSpec
from kiln.models.lora_names import BASE_DIGEST, is_adapter_name

#: Which PEFT projections each fused Megatron layer holds, in its row order per rank.
FUSED = {
    "self_attention.linear_qkv": ("q_proj", "k_proj", "v_proj"),
    "self_attention.linear_proj": ("o_proj",),
    "mlp.linear_fc1": ("gate_proj", "up_proj"),
    "mlp.linear_fc2": ("down_proj",),
}
PEFT_PREFIX = "base_model.model."
"""PEFT's key prefix: `base_model.model.<HF module>.lora_A.weight`."""


class Adapter(nn.Module):
    """A and B of one linear layer (this rank's shards), its scaling, and its fixed row mask."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor, row_mask: torch.Tensor | None, *,
                 parallel_mode: str, scaling: float, dropout: float) -> None:
        super().__init__()
        self.lora_A = nn.Parameter(a)
        self.lora_B = nn.Parameter(b)
        # Rows of projections not targeted: zero in B's forward, hence zero gradient too.
        self.register_buffer("row_mask", row_mask, persistent=False)
        self.parallel_mode = parallel_mode
        self.scaling = scaling
        self.dropout = nn.Dropout(dropout) if dropout else nn.Identity()

    def effective_b(self) -> torch.Tensor:
        return self.lora_B if self.row_mask is None else self.lora_B * self.row_mask

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel import mappings

        h = self.dropout(x) @ self.lora_A.t()  # [s, b, r]
        if self.parallel_mode == "column":
            h = mappings.copy_to_tensor_model_parallel_region(h)
        else:
            h = mappings.reduce_from_tensor_model_parallel_region(h)
        return (h @ self.effective_b().t()) * self.scaling


def _add_adapter_output(module: nn.Module, args: tuple, kwargs: dict, output: tuple) -> tuple:
    x = args[0] if args else kwargs["input_"]
    out, bias = output
    return out + module.lora(x).to(out.dtype), bias


def _targeted(lora: LoraSpec) -> dict[str, tuple[str, ...]]:
    """Megatron layer suffix -> the PEFT projections of it that are targeted (layers with none
    left out)."""
    chosen = {suffix: tuple(p for p in projs if p in lora.target_modules) for suffix, projs in FUSED.items()}
    return {s: p for s, p in chosen.items() if p}


def _row_mask(suffix: str, chosen: tuple[str, ...], out_local: int, spec: ArchSpec) -> torch.Tensor | None:
    """[out_local, 1] ones on the rows of targeted projections, or None when all are targeted."""
    projs = FUSED[suffix]
    if len(chosen) == len(projs):
        return None
    rank, tp = parallel.tp_rank(), parallel.tp_size()
    if suffix.endswith("linear_qkv"):
        from kiln.models.hf_io import fuse_qkv

        parts = [torch.full((n, 1), float(p in chosen)) for p, n in
                 zip(projs, (spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim,
                             spec.num_kv_heads * spec.head_dim))]
        full = fuse_qkv(*parts, spec)
        return torch.chunk(full, tp, dim=0)[rank].contiguous()
    # linear_fc1: each rank holds its gate rows, then its up rows.
    half = out_local // 2
    return torch.cat([torch.full((half, 1), float(p in chosen)) for p in projs])


def _initial_a(name: str, rank_r: int, in_features: int, seed: int) -> torch.Tensor:
    """The full A [r, in] of layer `name`, as PEFT initialises it (Kaiming-uniform with
    a = sqrt(5), i.e. U(-1/sqrt(in), 1/sqrt(in))), the same on every TP rank and size."""
    gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (1 << 63))
    bound = 1.0 / math.sqrt(in_features)
    return (torch.rand(rank_r, in_features, generator=gen, dtype=torch.float64) * 2 - 1) * bound


def attach(model: nn.Module, spec: ArchSpec, lora: LoraSpec, seed: int = 0) -> list[str]:
    """Freeze `model` and put an adapter on each targeted layer; returns the adapted layers'
    names. Call after the base weights are loaded."""
    from megatron.core.tensor_parallel import RowParallelLinear, set_tensor_model_parallel_attributes

    if spec.mla is not None:
        raise ValueError("spec.model.lora: LoRA is not supported for MLA models (DeepSeek-V3)")
    for p in model.parameters():
        p.requires_grad_(False)
        p.grad = None  # a full-weight step's gradient would count in the adapter's norm and clip
    chosen = _targeted(lora)
    rank, tp = parallel.tp_rank(), parallel.tp_size()
    adapted = []
    for name, module in model.named_modules():
        suffix = next((s for s in chosen if name.endswith("." + s) and ".experts." not in name), None)
        if suffix is None:
            continue
        weight = module.weight  # [out_local, in_local]
        out_local, in_local = weight.shape
        row = isinstance(module, RowParallelLinear)
        in_full = in_local * tp if row else in_local
        a = _initial_a(name, lora.rank, in_full, seed)
        if row:
            a = torch.chunk(a, tp, dim=1)[rank]
            b = torch.zeros(out_local, lora.rank)
        else:
            b = torch.zeros(out_local, lora.rank)
        mask = _row_mask(suffix, chosen[suffix], out_local, spec)
        dev, dt = weight.device, weight.dtype
        module.lora = Adapter(a.to(dev, dt).contiguous(), b.to(dev, dt),
                              None if mask is None else mask.to(dev, dt),
                              parallel_mode="row" if row else "column",
                              scaling=lora.scaling, dropout=lora.dropout)
        # The sharded factor counts once per rank in the gradient norm, the replicated once.
        set_tensor_model_parallel_attributes(module.lora.lora_A if row else module.lora.lora_B, True,
                                             1 if row else 0, 1)
        module.register_forward_hook(_add_adapter_output, with_kwargs=True)
        adapted.append(name)
    if not adapted:
        raise ValueError(f"spec.model.lora.targetModules {lora.target_modules}: no such layer in the model")
    model.kiln_lora = lora
    return adapted


def lora_of(model: nn.Module) -> LoraSpec | None:
    """The LoraSpec `attach` gave `model`, or None."""
    return getattr(model, "kiln_lora", None)


def adapter_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    return {n: p for n, p in model.named_parameters() if ".lora.lora_" in n}


def adapter_hf_tensors(model: nn.Module, spec: ArchSpec) -> Iterator[tuple[str, torch.Tensor]]:
    """`(PEFT name, full tensor)` of every targeted projection's A and B, layer by layer
    (collective at TP > 1: every rank must iterate to the end). Names:
    `base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight` ([r, in]) and
    `...lora_B.weight` ([out, r])."""
    from kiln.models.hf_io import split_qkv

    lora = lora_of(model)
    chosen = _targeted(lora)
    modules = dict(model.named_modules())
    for i in range(spec.num_layers):
        for suffix, projs in FUSED.items():
            module = modules.get(f"decoder.layers.{i}.{suffix}")
            if suffix not in chosen or module is None or not hasattr(module, "lora"):
                continue
            ad = module.lora
            a, b = ad.lora_A.detach(), ad.effective_b().detach()
            if ad.parallel_mode == "row":
                a_full, bs = parallel.all_gather_tp(a, 1), (b,)
            elif suffix.endswith("linear_qkv"):
                a_full, bs = a, split_qkv(parallel.all_gather_tp(b, 0), spec)
            else:
                a_full, bs = a, tuple(parallel.all_gather_tp(h, 0) for h in torch.chunk(b, 2, dim=0))
            group = "self_attn" if suffix.startswith("self_attention") else "mlp"
            for proj, b_full in zip(projs, bs):
                if proj in chosen[suffix]:
                    stem = f"{PEFT_PREFIX}model.layers.{i}.{group}.{proj}"
                    # A copy each: q/k/v (gate/up) share one A, saved as PEFT's separate tensors.
                    yield f"{stem}.lora_A.weight", a_full.clone()
                    yield f"{stem}.lora_B.weight", b_full


def base_weight_name(adapter_name: str) -> str:
    """The HF weight an adapter tensor applies to: `base_model.model.X.lora_A.weight` -> `X.weight`."""
    stem = adapter_name.removeprefix(PEFT_PREFIX).rsplit(".lora_", 1)[0]
    return stem + ".weight"


def adapter_deltas(adapter: Iterable[tuple[str, torch.Tensor]], scaling: float) -> dict[str, torch.Tensor]:
    """HF weight name -> scaling * B @ A (float32), from PEFT-named A/B tensors; ValueError
    when an A lacks its B or the reverse, or shapes disagree."""
    a, b = {}, {}
    for name, t in adapter:
        if not is_adapter_name(name):
            raise ValueError(f"{name!r} is not a LoRA adapter tensor (expected *.lora_A.weight or *.lora_B.weight)")
        (a if ".lora_A." in name else b)[base_weight_name(name)] = t
    if set(a) != set(b):
        raise ValueError(f"adapter tensors unpaired: A without B for {sorted(set(a) - set(b))[:3]}, "
                         f"B without A for {sorted(set(b) - set(a))[:3]}")
    out = {}
    for w in a:
        if a[w].dim() != 2 or b[w].dim() != 2 or a[w].shape[0] != b[w].shape[1]:
            raise ValueError(f"adapter of {w}: A {tuple(a[w].shape)} and B {tuple(b[w].shape)} "
                             "are not [r, in] and [out, r]")
        out[w] = (b[w].float() @ a[w].float()) * scaling
    return out


def merge_adapter(base: dict[str, torch.Tensor], adapter: Iterable[tuple[str, torch.Tensor]],
                  scaling: float) -> list[tuple[str, torch.Tensor]]:
    """Every weight of `base` (HF names), with `W + scaling * B @ A` in place of each adapted
    one. `base` is never modified: each version is merged into the pristine weights."""
    deltas = adapter_deltas(adapter, scaling)
    unknown = sorted(set(deltas) - set(base))
    if unknown:
        raise ValueError(f"adapter targets {unknown[:3]}, which the base model does not have")
    out = []
    for name, w in base.items():
        d = deltas.get(name)
        if d is not None:
            if d.shape != w.shape:
                raise ValueError(f"adapter of {name}: B @ A is {tuple(d.shape)}, the weight {tuple(w.shape)}")
            w = (w.float() + d).to(w.dtype)
        out.append((name, w))
    return out


def merged_hf_tensors(model: nn.Module, spec: ArchSpec) -> Iterator[tuple[str, torch.Tensor]]:
    """The full weights under HF names with the adapter merged in (collective at TP > 1):
    what an export with `--merge` and a stage's exported model hold."""
    from kiln.models.hf_io import iter_hf_tensors

    deltas = adapter_deltas(adapter_hf_tensors(model, spec), lora_of(model).scaling)
    for name, w in iter_hf_tensors(model, spec):
        d = deltas.get(name)
        yield name, w if d is None else (w.float() + d).to(w.dtype)


def peft_config(lora: LoraSpec, base_model: str) -> dict:
    """adapter_config.json of a PEFT LoRA adapter for `lora`."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
            "r": lora.rank, "lora_alpha": lora.alpha, "lora_dropout": lora.dropout,
            "target_modules": sorted(lora.target_modules), "bias": "none", "fan_in_fan_out": False,
            "inference_mode": True, "use_rslora": False, "use_dora": False, "modules_to_save": None,
            "init_lora_weights": True}


def write_peft_dir(tensors: list[tuple[str, torch.Tensor]], lora: LoraSpec, out_dir, *, source_dir,
                   base_model: str | None = None):
    """A PEFT adapter directory: adapter_config.json (naming `base_model`, default `source_dir`),
    adapter_model.safetensors and `source_dir`'s tokenizer files. Written under a temporary
    name and renamed."""
    import json
    import os
    import shutil
    from pathlib import Path

    from safetensors.torch import save_file

    from kiln.models.hf_io import fsync_dir, fsync_tree

    out_dir, source_dir = Path(out_dir), Path(source_dir)
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in source_dir.iterdir():
        if f.is_file() and (f.name.startswith("tokenizer") or f.name in ("special_tokens_map.json",
                                                                        "chat_template.jinja", "vocab.json",
                                                                        "merges.txt", "generation_config.json")):
            shutil.copyfile(f, tmp / f.name)
    (tmp / "adapter_config.json").write_text(json.dumps(peft_config(lora, base_model or str(source_dir)), indent=2))
    save_file({n: t.contiguous() for n, t in tensors}, str(tmp / "adapter_model.safetensors"),
              metadata={"format": "pt"})
    fsync_tree(tmp)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)
    fsync_dir(out_dir.parent)
    return out_dir


def weights_digest(named_tensors: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype) -> float:
    """A fingerprint of a set of weights: the sum of squares of every element once cast to the
    job's `dtype` (the trainer keeps norms in float32 in a bfloat16 model, an engine may not),
    in float64. Two engines holding the same weights agree on it to ~1e-12 relative (reduction
    order); any training step moves it far more."""
    return float(sum(t.detach().to(dtype).double().pow(2).sum() for _, t in named_tensors))


def same_digest(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-9 * max(abs(a), abs(b), 1.0)


def version_tensors(model: nn.Module, spec: ArchSpec, base_digest: float) -> Iterator[tuple[str, torch.Tensor]]:
    """What a LoRA policy version carries: the adapter (`adapter_hf_tensors`) and the digest of
    the base it applies to, so that a replica holding other base weights refuses it rather than
    serving a merge no trainer computed."""
    yield from adapter_hf_tensors(model, spec)
    yield BASE_DIGEST, torch.tensor([base_digest], dtype=torch.float64)
