"""Deterministic DeepSeek Sparse Attention (DSA) kernels.

indexer scores -> deterministic top-k -> sparse attention, each a Triton kernel beside a plain
PyTorch reference, chosen by `backend="auto" | "triton" | "torch"` (see `backend`).
"""
from kiln.kernels.dsa.backend import INTERPRET_ENV, Backend
from kiln.kernels.dsa.indexer import indexer_scores, indexer_scores_reference
from kiln.kernels.dsa.pipeline import DSAOutput, dsa_attention, index_hash
from kiln.kernels.dsa.sparse_attention import sparse_attention
from kiln.kernels.dsa.topk import topk_indices, topk_indices_reference

__all__ = [
    "INTERPRET_ENV",
    "Backend",
    "DSAOutput",
    "dsa_attention",
    "index_hash",
    "indexer_scores",
    "indexer_scores_reference",
    "sparse_attention",
    "topk_indices",
    "topk_indices_reference",
]
