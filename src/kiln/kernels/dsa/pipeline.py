"""DSA in one call, and a hash of the keys it selected.

`dsa_attention` chains indexer scores -> deterministic top-k -> sparse attention and returns the
output with the selected indices. `index_hash` turns one layer's indices into a stable 64-bit
number, so a trainer can check that it selected exactly the keys the rollout engine selected for
the same tokens without shipping the indices themselves (k x positions per layer is too large).

Not covered: caching indexer keys across decode steps (the caller owns its KV and indexer caches).
"""
from __future__ import annotations

import hashlib
from typing import NamedTuple

import torch

from kiln.kernels.dsa import backend as _backend
from kiln.kernels.dsa.indexer import indexer_scores
from kiln.kernels.dsa.sparse_attention import sparse_attention
from kiln.kernels.dsa.topk import topk_indices


class DSAOutput(NamedTuple):
    out: torch.Tensor
    """[batch, tokens, heads, dim], dtype of q."""
    indices: torch.Tensor
    """[batch, tokens, topk] int64, -1 where a row had fewer than topk earlier keys."""


def dsa_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    index_q: torch.Tensor,
    index_k: torch.Tensor,
    index_w: torch.Tensor,
    topk: int,
    scale: float | None = None,
    offset: int | None = None,
    query_chunk: int | None = None,
    backend: _backend.Backend = "auto",
) -> DSAOutput:
    """Causal DeepSeek sparse attention.

    q [batch, tokens, heads, dim]; k, v [batch, keys, kv_heads, dim]; index_q [batch, tokens,
    indexer_heads, index_dim]; index_k [batch, keys, index_dim]; index_w [batch, tokens,
    indexer_heads]. Query t sits at position t + offset (default keys - tokens). The indexer is
    not differentiated (it is frozen during RL); q, k and v are. `query_chunk` computes the
    [tokens, keys] indexer scores that many query rows at a time, to bound memory; each row's
    indices are the same either way.
    """
    tokens, keys = index_q.shape[1], index_k.shape[1]
    if offset is None:
        offset = keys - tokens
    if query_chunk is not None and query_chunk < 1:
        raise ValueError(f"query_chunk must be a positive int or None, got {query_chunk!r}")
    chunk = tokens if query_chunk is None else query_chunk
    with torch.no_grad():
        parts = []
        for start in range(0, tokens, max(chunk, 1)):
            stop = min(start + chunk, tokens)
            scores = indexer_scores(
                index_q[:, start:stop], index_k, index_w[:, start:stop],
                offset=offset + start, backend=backend,
            )
            parts.append(topk_indices(scores, topk, backend=backend))
        indices = torch.cat(parts, dim=1) if parts else torch.empty(
            index_q.shape[0], 0, topk, dtype=torch.int64, device=index_q.device
        )
    out = sparse_attention(q, k, v, indices, scale=scale, backend=backend)
    return DSAOutput(out, indices)


def index_hash(indices: torch.Tensor) -> int:
    """A stable unsigned 64-bit hash of one layer's selected indices (shape included).

    blake2b over the shape and the little-endian int64 bytes, so it is the same on any machine,
    device or process. Hash one trajectory's rows by passing its slice, e.g. `indices[b:b + 1]`.
    """
    if indices.dtype != torch.int64:
        raise ValueError(f"indices must be int64, got {indices.dtype}")
    data = indices.detach().to("cpu").contiguous().numpy().astype("<i8", copy=False)
    digest = hashlib.blake2b(digest_size=8, person=b"kiln-dsa-idx")
    digest.update(repr(tuple(indices.shape)).encode("ascii"))
    digest.update(data.tobytes())
    return int.from_bytes(digest.digest(), "little")
