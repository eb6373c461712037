"""Deterministic top-k over indexer scores: the keys each query token attends to.

Shapes and dtypes:
    scores_BTS  [batch, tokens, keys]  float32, bfloat16 or float16 (float64: PyTorch path only)
    returns     [batch, tokens, k]     int64 key indices

The order is total, so the answer is unique: higher score first, equal scores by lower index,
-0.0 equal to +0.0. Only finite scores can be selected (the causal mask writes -inf; NaN and +inf
are treated the same way, as not selectable); a row with fewer than k finite scores is padded
with -1 at the end. A row's result depends on that row alone, never on the rest of the batch.

How: every score becomes one int64 key whose order is the order above and which is unique within
a row: the float32 score mapped to an order-preserving int32 in the high half, (keys - 1 - index)
in the low half. With no ties left, any correct top-k returns the same thing: `torch.topk` on the
keys here; in the Triton kernel a running best-KB buffer merged with each block of KB keys by a
bitonic network (the top KB of sorted lists A and B is in max(A[i], B[KB-1-i])). float64 scores
do not fit that packing; the PyTorch path sorts them with a stable sort instead.

Not covered: k > 2**15 in the Triton kernel (the buffer lives in registers).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.kernels.dsa import backend as _backend

_INT64_MIN = -(2**63)
_MAX_TRITON_K = 2**15


def _topk_kernel(
    s_ptr, out_ptr,
    R, T, S, K, sentinel,
    ssb, sst, sss,
    sob, sot, sok,
    BLOCK_R: tl.constexpr, KB: tl.constexpr, LOG_KB: tl.constexpr,
):
    # BLOCK_R rows (flat over batch and tokens) per program, side by side. The sorting network is
    # written out here with reshape/split/join rather than tl.sort, whose interpreted form is
    # element-by-element Python (minutes for a test); on a GPU both are bitonic networks.
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < R
    b = (rows // T).to(tl.int64)
    t = (rows % T).to(tl.int64)
    lanes = tl.arange(0, KB)
    row_ptr = s_ptr + b * ssb + t * sst
    best = tl.full([BLOCK_R, KB], sentinel, tl.int64)  # each row sorted descending throughout
    for start in range(0, S, KB):
        offs = start + lanes
        in_row = row_ok[:, None] & (offs < S)[None, :]
        x = tl.load(row_ptr[:, None] + offs[None, :] * sss, mask=in_row, other=float("-inf")).to(tl.float32)
        # -0.0 must rank equal to +0.0; only finite scores are selectable.
        x = tl.where(x == 0.0, 0.0, x)
        selectable = in_row & (x == x) & (x != float("inf")) & (x != float("-inf"))
        bits = x.to(tl.int32, bitcast=True)
        ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
        key = (ordered.to(tl.int64) << 32) | (S - 1 - offs).to(tl.int64)[None, :]
        key = tl.where(selectable, key, sentinel)

        # Bitonic sort of the block, ascending: stage s merges runs of 2**s, each run ascending
        # or descending by bit s of its position; step j compares elements 2**j apart.
        for stage in tl.static_range(1, LOG_KB + 1):
            for jj in tl.static_range(0, stage):
                j: tl.constexpr = stage - 1 - jj
                runs: tl.constexpr = KB >> (j + 1)
                span: tl.constexpr = 1 << j
                pairs = tl.permute(tl.reshape(key, [BLOCK_R, runs, 2, span]), [0, 1, 3, 2])
                lo, hi = tl.split(pairs)
                down = ((tl.arange(0, runs) >> (stage - 1 - j)) & 1)[None, :, None] == 1
                small = tl.minimum(lo, hi)
                large = tl.maximum(lo, hi)
                pairs = tl.join(tl.where(down, large, small), tl.where(down, small, large))
                key = tl.reshape(tl.permute(pairs, [0, 1, 3, 2]), [BLOCK_R, KB])

        # max(best descending, block ascending) holds the top KB of both and is bitonic; one
        # merge pass sorts it descending.
        merged = tl.maximum(best, key)
        for jj in tl.static_range(0, LOG_KB):
            j: tl.constexpr = LOG_KB - 1 - jj
            runs: tl.constexpr = KB >> (j + 1)
            span: tl.constexpr = 1 << j
            pairs = tl.permute(tl.reshape(merged, [BLOCK_R, runs, 2, span]), [0, 1, 3, 2])
            lo, hi = tl.split(pairs)
            pairs = tl.join(tl.maximum(lo, hi), tl.minimum(lo, hi))
            merged = tl.reshape(tl.permute(pairs, [0, 1, 3, 2]), [BLOCK_R, KB])
        best = merged

    index = tl.where(best == sentinel, -1, (S - 1) - (best & 0xFFFFFFFF))
    out_mask = row_ok[:, None] & (lanes < K)[None, :]
    tl.store(out_ptr + (b * sob + t * sot)[:, None] + lanes[None, :] * sok, index, mask=out_mask)


def topk_indices(scores: torch.Tensor, k: int, backend: _backend.Backend = "auto") -> torch.Tensor:
    """Indices of the k best-scoring keys per query row; see the module docstring."""
    _check(scores, k)
    if _backend.resolve(backend, scores) == "torch":
        return topk_indices_reference(scores, k)
    return _topk_triton(scores, k)


def topk_indices_reference(scores: torch.Tensor, k: int) -> torch.Tensor:
    """PyTorch top-k with the same total order: packed int64 keys, or a stable sort for float64."""
    _check(scores, k)
    batch, tokens, keys = scores.shape
    take = min(k, keys)
    if scores.dtype == torch.float64:
        x = torch.where(scores == 0.0, 0.0, scores)
        x = torch.where(torch.isfinite(x), x, float("-inf"))
        values, index = torch.sort(x, dim=-1, descending=True, stable=True)
        values, index = values[..., :take], index[..., :take]
        index = torch.where(torch.isfinite(values), index, -1)
    else:
        packed = pack_keys(scores)
        best = torch.topk(packed, take, dim=-1, largest=True, sorted=True).values
        index = torch.where(best == _INT64_MIN, -1, (keys - 1) - (best & 0xFFFFFFFF))
    if take < k:
        pad = torch.full((batch, tokens, k - take), -1, dtype=torch.int64, device=scores.device)
        index = torch.cat([index, pad], dim=-1)
    return index


def pack_keys(scores: torch.Tensor) -> torch.Tensor:
    """int64 keys ordered like (score, -index), -0.0 == +0.0, non-finite scores at INT64_MIN."""
    keys = scores.shape[-1]
    x = scores.to(torch.float32)
    x = torch.where(x == 0.0, 0.0, x)
    bits = x.view(torch.int32)
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(torch.int64)
    low = (keys - 1) - torch.arange(keys, device=scores.device, dtype=torch.int64)
    packed = (ordered << 32) | low
    return torch.where(torch.isfinite(x), packed, _INT64_MIN)


def _topk_triton(scores: torch.Tensor, k: int) -> torch.Tensor:
    if scores.dtype == torch.float64:
        raise ValueError("scores: the Triton top-k takes float32/bfloat16/float16; use backend='torch' for float64")
    if k > _MAX_TRITON_K:
        raise ValueError(f"k={k} exceeds the Triton top-k limit of {_MAX_TRITON_K}; use backend='torch'")
    batch, tokens, keys = scores.shape
    out = torch.empty(batch, tokens, k, dtype=torch.int64, device=scores.device)
    if out.numel() == 0:
        return out
    kb = max(64, triton.next_power_of_2(k))
    block_r = max(1, min(16, 1024 // kb))
    rows = batch * tokens
    kernel = _backend.jit(_topk_kernel)
    kernel[(triton.cdiv(rows, block_r),)](
        scores, out, rows, tokens, keys, k, _INT64_MIN,
        *scores.stride(), *out.stride(),
        BLOCK_R=block_r, KB=kb, LOG_KB=kb.bit_length() - 1,
    )
    return out


def _check(scores: torch.Tensor, k: int) -> None:
    if scores.dim() != 3:
        raise ValueError(f"scores must be [batch, tokens, keys], got shape {tuple(scores.shape)}")
    if scores.dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        raise ValueError(f"scores must be a float tensor, got {scores.dtype}")
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be a positive int, got {k!r}")
    if scores.shape[-1] >= 2**32:
        raise ValueError(f"scores: at most 2**32 - 1 keys per row, got {scores.shape[-1]}")
