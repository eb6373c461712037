"""Sparse attention over the keys chosen by top-k, forward and deterministic backward.

    out[b, t, h] = sum_j softmax_j(scale * q[b, t, h] . k[b, i_j, h // G]) * v[b, i_j, h // G]
    over the slots j with i_j = indices[b, t, j] >= 0; G = heads / kv_heads.

Shapes and dtypes:
    q_BTHD        [batch, tokens, heads, dim]        float32, bfloat16, float16 or float64
    k_BSKD, v     [batch, keys, kv_heads, dim]       same dtype as q
    indices_BTN   [batch, tokens, topk]              int64 key positions, -1 = unused slot
    returns       [batch, tokens, heads, dim]        dtype of q
A query row with no used slot returns zeros (and passes no gradient). The same key listed twice
in one row counts twice, as two slots.

Determinism, forward and backward, with no atomics anywhere:
- forward and dQ: one program per (batch, token, kv head) walks the row's slots in blocks, in
  order, with a fixed online-softmax update;
- dK and dV: the slots are grouped by key with a stable sort, so each key's list of queries is in
  ascending token order; one program per (batch, key, kv head) walks that list in blocks of a
  fixed size counted from the start of the key's own list. Nothing a key sums depends on the
  rest of the batch, so a row gives the same bits alone, in a batch, or in a permuted batch.
The PyTorch path follows the same plan: per-slot contributions, then a per-key sum in that same
order (a loop over the rank within each key's list, so no two additions race).

Arithmetic is float32 (float64 for float64 inputs): bfloat16/float16 tiles are widened on load
and `tl.dot` runs with input_precision="ieee" (no TF32), so Triton's interpreter, which gets bf16
arithmetic wrong, runs exactly the arithmetic a GPU runs. Tensor-core bf16 dots are not used.

Not covered: a key/value dim different from the query dim, dropout, attention sinks, FP8.
"""
from __future__ import annotations

import math

import torch

from kiln.kernels.dsa import backend as _backend
from kiln.kernels.dsa import sparse_attention_kernels as _kernels

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    indices: torch.Tensor,
    scale: float | None = None,
    backend: _backend.Backend = "auto",
) -> torch.Tensor:
    """Attention of each query over its selected keys; differentiable in q, k and v."""
    scale = _check(q, k, v, indices, scale)
    use_triton = _backend.resolve(backend, q, k, v, indices) == "triton"
    return _SparseAttention.apply(q, k, v, indices, scale, use_triton)


class _SparseAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, indices, scale, use_triton):  # type: ignore[override]
        impl = _triton_forward if use_triton else _torch_forward
        out, lse = impl(q, k, v, indices, scale)
        ctx.save_for_backward(q, k, v, indices, out, lse)
        ctx.scale = scale
        ctx.use_triton = use_triton
        ctx.mark_non_differentiable(indices)
        return out

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        q, k, v, indices, out, lse = ctx.saved_tensors
        impl = _triton_backward if ctx.use_triton else _torch_backward
        dq, dk, dv = impl(q, k, v, indices, out, lse, grad_out, ctx.scale)
        return dq, dk, dv, None, None, None


# ---------------------------------------------------------------------------------------------
# PyTorch path


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _gather(q, k, v, indices, acc):
    """q grouped by kv head, and the selected keys/values per slot, in the accumulator dtype."""
    batch, tokens, heads, dim = q.shape
    kv_heads = k.shape[2]
    keys, slots = k.shape[1], indices.shape[2]
    valid = indices >= 0
    # Whole rows of [batch * keys, kv_heads * dim] by index_select: a copy per row, not per element.
    flat = (torch.arange(batch, device=q.device)[:, None, None] * keys + indices.clamp(min=0)).reshape(-1)
    sel_shape = (batch, tokens, slots, kv_heads, dim)
    k_sel = k.reshape(batch * keys, kv_heads * dim).index_select(0, flat).reshape(sel_shape).to(acc)
    v_sel = v.reshape(batch * keys, kv_heads * dim).index_select(0, flat).reshape(sel_shape).to(acc)
    q_g = q.reshape(batch, tokens, kv_heads, heads // kv_heads, dim).to(acc)  # [B, T, KH, G, D]
    return q_g, k_sel, v_sel, valid


def _logits(q_g, k_sel, valid, scale):
    logits = torch.einsum("btkgd,btnkd->btkgn", q_g, k_sel) * scale  # [B, T, KH, G, N]
    return logits.masked_fill(~valid[:, :, None, None, :], float("-inf"))


def _torch_forward(q, k, v, indices, scale):
    acc = _acc_dtype(q.dtype)
    q_g, k_sel, v_sel, valid = _gather(q, k, v, indices, acc)
    logits = _logits(q_g, k_sel, valid, scale)
    m = logits.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isneginf(m), 0.0, m)  # an empty row: keep exp() away from -inf - -inf
    p = torch.exp(logits - m)
    total = p.sum(dim=-1, keepdim=True)
    p = torch.where(total > 0, p / total, 0.0)
    out = torch.einsum("btkgn,btnkd->btkgd", p, v_sel)
    lse = torch.where(total > 0, m + torch.log(total), float("-inf")).squeeze(-1)
    return out.reshape(q.shape).to(q.dtype), lse.reshape(q.shape[:3])


def _torch_backward(q, k, v, indices, out, lse, grad_out, scale):
    batch, tokens, heads, dim = q.shape
    keys, kv_heads = k.shape[1], k.shape[2]
    group = heads // kv_heads
    acc = _acc_dtype(q.dtype)
    q_g, k_sel, v_sel, valid = _gather(q, k, v, indices, acc)
    do_g = grad_out.reshape(batch, tokens, kv_heads, group, dim).to(acc)
    delta = (grad_out.to(acc) * out.to(acc)).sum(dim=-1).reshape(batch, tokens, kv_heads, group)
    lse_g = lse.reshape(batch, tokens, kv_heads, group, 1)
    logits = _logits(q_g, k_sel, valid, scale)
    p = torch.where(valid[:, :, None, None, :], torch.exp(logits - lse_g), 0.0)
    dp = torch.einsum("btkgd,btnkd->btkgn", do_g, v_sel)
    ds = p * (dp - delta[..., None])
    dq = torch.einsum("btkgn,btnkd->btkgd", ds, k_sel) * scale
    dk_slot = torch.einsum("btkgn,btkgd->btnkd", ds, q_g) * scale  # [B, T, N, KH, D]
    dv_slot = torch.einsum("btkgn,btkgd->btnkd", p, do_g)
    segment = _key_segments(indices, keys)
    dk = _sum_by_key(dk_slot, segment, batch * keys).reshape(k.shape)
    dv = _sum_by_key(dv_slot, segment, batch * keys).reshape(v.shape)
    return dq.reshape(q.shape).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _key_segments(indices: torch.Tensor, keys: int) -> torch.Tensor:
    """Per slot, the flat key id b * keys + index, or batch * keys for an unused slot."""
    batch = indices.shape[0]
    base = (torch.arange(batch, device=indices.device) * keys)[:, None, None]
    return torch.where(indices >= 0, base + indices, batch * keys).reshape(-1)


def _sum_by_key(slot_values: torch.Tensor, segment: torch.Tensor, num_keys: int) -> torch.Tensor:
    """Sum per-slot rows into their keys, each key adding its slots in (token, slot) order."""
    flat = slot_values.reshape(segment.numel(), -1)
    out = torch.zeros(num_keys, flat.shape[1], dtype=flat.dtype, device=flat.device)
    sorted_seg, order = torch.sort(segment, stable=True)
    used = int((sorted_seg < num_keys).sum())
    if used == 0:
        return out
    sorted_seg, order = sorted_seg[:used], order[:used]
    seg_keys, counts = torch.unique_consecutive(sorted_seg, return_counts=True)
    starts = torch.cumsum(counts, 0) - counts
    # Rank r adds the r-th slot of every key that has more than r slots; within one rank the
    # keys are distinct, so each step is a plain, race-free update.
    by_count, perm = torch.sort(counts, descending=True, stable=True)
    ranks = torch.arange(int(by_count[0]), device=flat.device)
    active = (by_count[None, :] > ranks[:, None]).sum(dim=1).tolist()
    values = flat[order]
    for r, n in enumerate(active):
        segs = perm[:n]
        out[seg_keys[segs]] += values[starts[segs] + r]
    return out


# ---------------------------------------------------------------------------------------------
# Triton path


def _triton_forward(q, k, v, indices, scale):
    batch, tokens, heads, dim = q.shape
    kv_heads = k.shape[2]
    plan = _kernels.plan(q.dtype, heads // kv_heads, dim)
    out = torch.empty_like(q)
    lse = torch.empty(batch, tokens, heads, dtype=plan.acc_torch, device=q.device)
    if q.numel() == 0:
        return out, lse.fill_(float("-inf"))
    kernel = _backend.jit(_kernels.forward_kernel)
    kernel[(tokens, batch, kv_heads)](
        q, k, v, indices, out, lse,
        indices.shape[2], heads // kv_heads, dim, scale,
        *q.stride(), *k.stride(), *v.stride(), *indices.stride(), *out.stride(), *lse.stride(),
        **plan.meta,
    )
    return out, lse


def _triton_backward(q, k, v, indices, out, lse, grad_out, scale):
    batch, tokens, heads, dim = q.shape
    keys, kv_heads = k.shape[1], k.shape[2]
    group = heads // kv_heads
    plan = _kernels.plan(q.dtype, group, dim)
    grad_out = grad_out.contiguous()
    delta = (grad_out.to(plan.acc_torch) * out.to(plan.acc_torch)).sum(dim=-1)  # [B, T, H]
    dq = torch.empty_like(q)
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)

    dq_kernel = _backend.jit(_kernels.dq_kernel)
    dq_kernel[(tokens, batch, kv_heads)](
        q, k, v, indices, grad_out, lse, delta, dq,
        indices.shape[2], group, dim, scale,
        *q.stride(), *k.stride(), *v.stride(), *indices.stride(), *grad_out.stride(),
        *lse.stride(), *delta.stride(), *dq.stride(),
        **plan.meta,
    )

    # Each key's list of querying tokens, ascending: a stable sort of the flat key ids keeps the
    # (token, slot) order of equal ids.
    segment = _key_segments(indices, keys)
    sorted_seg, order = torch.sort(segment, stable=True)
    slots = indices.shape[2]
    tokens_by_key = torch.div(order % (tokens * slots), slots, rounding_mode="floor")
    bounds = torch.arange(batch * keys + 1, device=q.device)
    seg_start = torch.searchsorted(sorted_seg, bounds)

    dkv_kernel = _backend.jit(_kernels.dkv_kernel)
    dkv_kernel[(keys, batch, kv_heads)](
        q, k, v, grad_out, lse, delta, tokens_by_key, seg_start, dk, dv,
        keys, group, dim, scale,
        *q.stride(), *k.stride(), *v.stride(), *grad_out.stride(),
        *lse.stride(), *delta.stride(), *dk.stride(), *dv.stride(),
        BLOCK_M=plan.block_m, BLOCK_G=plan.meta["BLOCK_G"], BLOCK_D=plan.meta["BLOCK_D"],
        ACC_DTYPE=plan.meta["ACC_DTYPE"],
    )
    return dq, dk, dv


# ---------------------------------------------------------------------------------------------


def _check(q, k, v, indices, scale) -> float:
    if q.dim() != 4:
        raise ValueError(f"q must be [batch, tokens, heads, dim], got shape {tuple(q.shape)}")
    batch, tokens, heads, dim = q.shape
    if k.dim() != 4 or k.shape[0] != batch or k.shape[3] != dim:
        raise ValueError(f"k must be [batch={batch}, keys, kv_heads, dim={dim}], got {tuple(k.shape)}")
    if v.shape != k.shape:
        raise ValueError(f"v must have k's shape {tuple(k.shape)}, got {tuple(v.shape)}")
    kv_heads = k.shape[2]
    if kv_heads == 0 or heads % kv_heads != 0:
        raise ValueError(f"heads ({heads}) must be a multiple of kv_heads ({kv_heads})")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dtype not in _FLOAT_DTYPES:
            raise ValueError(f"{name} must be float32, bfloat16, float16 or float64, got {t.dtype}")
        if t.dtype != q.dtype:
            raise ValueError(f"{name} has dtype {t.dtype}, q has {q.dtype}; they must match")
    if indices.dtype != torch.int64 or indices.dim() != 3 or tuple(indices.shape[:2]) != (batch, tokens):
        raise ValueError(
            f"indices must be int64 [batch={batch}, tokens={tokens}, topk], "
            f"got {indices.dtype} {tuple(indices.shape)}"
        )
    keys = k.shape[1]
    if indices.numel() and bool(((indices < -1) | (indices >= keys)).any()):
        raise ValueError(f"indices must lie in [0, {keys}) or be -1 for an unused slot")
    if scale is None:
        return 1.0 / math.sqrt(dim)
    return float(scale)
