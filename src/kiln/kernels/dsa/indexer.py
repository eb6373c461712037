"""Lightning-indexer scores: how much each query token wants each earlier key token.

    I[b, t, s] = sum_h w[b, t, h] * relu(q[b, t, h, :] . k[b, s, :])     for s <= t + offset
    I[b, t, s] = -inf                                                      for s >  t + offset

Shapes and dtypes:
    q_BTHD   [batch, tokens, indexer_heads, dim]   float32, bfloat16, float16 or float64
    k_BSD    [batch, keys, dim]                    same dtype as q (one key head, shared)
    w_BTH    [batch, tokens, indexer_heads]        same dtype as q
    returns  [batch, tokens, keys]                 float32 (float64 for float64 inputs)

Query t sits at position t + offset; `offset` defaults to keys - tokens, so a prefill (tokens ==
keys) gets 0 and a decode step of one new token over a cache of S keys sees all S of them.

Arithmetic is float32 (float64 for float64 inputs) with a fixed order: heads are summed one after
another, h = 0, 1, ..., and each score depends only on its own row of q, w and the keys, so a row
gives the same bits alone or inside any batch. bfloat16/float16 inputs are widened to float32 on
load and multiplied with input_precision="ieee" (no TF32), so the interpreter (which gets bf16
arithmetic wrong) runs exactly the arithmetic a GPU runs; tensor-core bf16 dots are not used.

Not covered: FP8 inputs, and a backward pass (the indexer is frozen during RL).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.kernels.dsa import backend as _backend

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _indexer_kernel(
    q_ptr, k_ptr, w_ptr, out_ptr,
    T, S, H, D, offset,
    sqb, sqt, sqh, sqd,
    skb, sks, skd,
    swb, swt, swh,
    sob, sot, sos,
    BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
    USE_DOT: tl.constexpr, ACC_DTYPE: tl.constexpr,
):
    pid_t = tl.program_id(0)
    pid_s = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_s = pid_s * BLOCK_S + tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_t = offs_t < T
    mask_s = offs_s < S
    mask_d = offs_d < D

    k_tile = tl.load(
        k_ptr + b * skb + offs_s[:, None] * sks + offs_d[None, :] * skd,
        mask=mask_s[:, None] & mask_d[None, :], other=0.0,
    ).to(ACC_DTYPE)
    acc = tl.zeros((BLOCK_T, BLOCK_S), dtype=ACC_DTYPE)
    for h in range(0, H):
        q_tile = tl.load(
            q_ptr + b * sqb + offs_t[:, None] * sqt + h * sqh + offs_d[None, :] * sqd,
            mask=mask_t[:, None] & mask_d[None, :], other=0.0,
        ).to(ACC_DTYPE)
        w_h = tl.load(w_ptr + b * swb + offs_t * swt + h * swh, mask=mask_t, other=0.0)
        if USE_DOT:
            logits = tl.dot(q_tile, tl.trans(k_tile), input_precision="ieee")
        else:
            logits = tl.sum(q_tile[:, None, :] * k_tile[None, :, :], axis=2)
        acc += w_h[:, None].to(ACC_DTYPE) * tl.maximum(logits, 0.0)

    causal = offs_s[None, :] <= offs_t[:, None] + offset
    acc = tl.where(causal, acc, float("-inf"))
    tl.store(
        out_ptr + b * sob + offs_t[:, None] * sot + offs_s[None, :] * sos,
        acc, mask=mask_t[:, None] & mask_s[None, :],
    )


def indexer_scores(
    q: torch.Tensor,
    k: torch.Tensor,
    w: torch.Tensor,
    offset: int | None = None,
    backend: _backend.Backend = "auto",
) -> torch.Tensor:
    """Causal indexer scores [batch, tokens, keys]; see the module docstring."""
    offset = _check(q, k, w, offset)
    if _backend.resolve(backend, q, k, w) == "torch":
        return indexer_scores_reference(q, k, w, offset)
    return _indexer_triton(q, k, w, offset)


def indexer_scores_reference(
    q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, offset: int | None = None
) -> torch.Tensor:
    """Plain PyTorch indexer scores, summing heads in order like the kernel."""
    offset = _check(q, k, w, offset)
    acc_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    batch, tokens, heads, _ = q.shape
    keys = k.shape[1]
    k_f = k.to(acc_dtype)
    out = torch.zeros(batch, tokens, keys, dtype=acc_dtype, device=q.device)
    for h in range(heads):
        logits = torch.matmul(q[:, :, h, :].to(acc_dtype), k_f.transpose(1, 2))
        out += w[:, :, h, None].to(acc_dtype) * torch.relu(logits)
    pos_t = torch.arange(tokens, device=q.device)[:, None] + offset
    pos_s = torch.arange(keys, device=q.device)[None, :]
    return out.masked_fill(pos_s > pos_t, float("-inf"))


def _indexer_triton(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, offset: int) -> torch.Tensor:
    batch, tokens, heads, dim = q.shape
    keys = k.shape[1]
    f64 = q.dtype == torch.float64
    out = torch.empty(batch, tokens, keys, dtype=torch.float64 if f64 else torch.float32, device=q.device)
    if out.numel() == 0:
        return out
    block_t, block_s = 32, 32
    block_d = max(16, triton.next_power_of_2(dim))
    kernel = _backend.jit(_indexer_kernel)
    grid = (triton.cdiv(tokens, block_t), triton.cdiv(keys, block_s), batch)
    kernel[grid](
        q, k, w, out,
        tokens, keys, heads, dim, offset,
        *q.stride(), *k.stride(), *w.stride(), *out.stride(),
        BLOCK_T=block_t, BLOCK_S=block_s, BLOCK_D=block_d,
        USE_DOT=not f64, ACC_DTYPE=tl.float64 if f64 else tl.float32,
    )
    return out


def _check(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, offset: int | None) -> int:
    if q.dim() != 4:
        raise ValueError(f"q must be [batch, tokens, indexer_heads, dim], got shape {tuple(q.shape)}")
    batch, tokens, heads, dim = q.shape
    if k.dim() != 3 or k.shape[0] != batch or k.shape[2] != dim:
        raise ValueError(f"k must be [batch={batch}, keys, dim={dim}], got shape {tuple(k.shape)}")
    if tuple(w.shape) != (batch, tokens, heads):
        raise ValueError(f"w must be [batch, tokens, indexer_heads]={[batch, tokens, heads]}, got {list(w.shape)}")
    for name, t in (("q", q), ("k", k), ("w", w)):
        if t.dtype not in _FLOAT_DTYPES:
            raise ValueError(f"{name} must be float32, bfloat16, float16 or float64, got {t.dtype}")
        if t.dtype != q.dtype:
            raise ValueError(f"{name} has dtype {t.dtype}, q has {q.dtype}; they must match")
    keys = k.shape[1]
    if offset is None:
        offset = keys - tokens
    if offset < 0:
        raise ValueError(f"offset must be >= 0 (query t sits at position t + offset), got {offset}")
    return int(offset)
