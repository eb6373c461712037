"""Packed sequences: several sequences concatenated into one row of a forward pass, with
attention kept within each and rotary positions restarting at each one.

Why: agentic episodes have the most long-tailed lengths there are (a 9-call chain beside a
30-turn SWE episode), and a right-padded `[B, S]` micro-batch spends most of its compute on
padding. A packed row `[1, T]` holds only real tokens.

How, on Megatron-core without transformer-engine (the CPU build): Megatron's own packed path
(`PackedSeqParams`, THD format with `cu_seqlens`) needs TE's or flash-attention's varlen
kernels. Kiln keeps Megatron's model and changes two things while `packed(model, lengths)` is
active:
- attention: the SDPA core attention (`megatron_model._sdpa_attention_class`) runs causal SDPA
  once per sequence of the row (a varlen loop: exact, and O(sum of n^2), where a
  block-diagonal mask over the row would be O(T^2)); Megatron's local attention gets a
  block-diagonal causal mask instead (`block_causal_mask`);
- positions: the model's rotary embedding returns the frequencies of each token's position
  within its own sequence, so RoPE restarts at 0 at each boundary.
Everything else in a decoder layer is per token (norms, MLPs, MoE routing), so it needs no
change. DSA models are refused: their indexer selects over the whole row.
"""
from __future__ import annotations

import contextvars
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

_SEGMENTS: contextvars.ContextVar[tuple[int, ...] | None] = contextvars.ContextVar("kiln_packed_segments",
                                                                                 default=None)


def segments() -> tuple[int, ...] | None:
    """The lengths of the sequences packed into the current forward's row, or None."""
    return _SEGMENTS.get()


def positions(lengths: Sequence[int], device: torch.device | None = None) -> torch.Tensor:
    """`[T]` each token's position within its own sequence."""
    return torch.cat([torch.arange(n, device=device) for n in lengths])


def block_causal_mask(lengths: Sequence[int], device: torch.device | None = None) -> torch.Tensor:
    """Megatron's mask convention (True where attention is NOT allowed), `[1, 1, T, T]`: each
    token sees the tokens before it in its own sequence only."""
    seq = torch.cat([torch.full((n,), i, device=device) for i, n in enumerate(lengths)])
    pos = positions(lengths, device)
    allowed = (seq[:, None] == seq[None, :]) & (pos[None, :] <= pos[:, None])
    return ~allowed[None, None]


def varlen_attention(attend, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     lengths: Sequence[int]) -> torch.Tensor:
    """`attend(q, k, v)` (causal, `[b, heads, s, d]` in and out) once per packed sequence,
    along the sequence dimension (2), concatenated back."""
    outs, start = [], 0
    for n in lengths:
        sl = slice(start, start + n)
        outs.append(attend(q[:, :, sl], k[:, :, sl], v[:, :, sl]))
        start += n
    return torch.cat(outs, dim=2)


@contextmanager
def packed(model, lengths: Sequence[int]) -> Iterator[None]:
    """While active, `model`'s forward over one row of `sum(lengths)` tokens treats it as those
    sequences concatenated (module doc). ValueError for what cannot be packed."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from kiln.models.dsa import is_dsa_model

    if is_dsa_model(model):
        raise ValueError("packed sequences are not supported for DSA models: the indexer selects "
                         "over the whole row; leave trainer.maxTokensPerMicroBatch unset")
    rope = getattr(model, "rotary_pos_emb", None)
    if rope is not None and type(rope) is not RotaryEmbedding:
        raise ValueError(f"packed sequences need plain rotary embeddings; this model has "
                         f"{type(rope).__name__}: leave trainer.maxTokensPerMicroBatch unset")
    lengths = tuple(int(n) for n in lengths)
    token = _SEGMENTS.set(lengths)
    original = rope.forward if rope is not None else None
    if rope is not None:
        pos = positions(lengths, next(model.parameters()).device)

        def restart(max_seq_len, offset=0, packed_seq=False, cp_group=None):  # noqa: ARG001
            # The frequencies of positions 0..max(lengths)-1, gathered per token: [T, 1, 1, d].
            return original(max(lengths), offset, False, cp_group)[pos]

        rope.forward = restart
    try:
        yield
    finally:
        _SEGMENTS.reset(token)
        if rope is not None:
            rope.__dict__.pop("forward", None)  # the class's forward again


def plan(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Micro-batches by a token budget: indices into `lengths`, each group's total at most
    `budget` (a sequence longer than the budget goes alone). First-fit decreasing: few groups,
    and deterministic, so every data-parallel rank derives the same plan."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    groups: list[list[int]] = []
    totals: list[int] = []
    for i in order:
        for g, total in enumerate(totals):
            if total + lengths[i] <= budget:
                groups[g].append(i)
                totals[g] += lengths[i]
                break
        else:
            groups.append([i])
            totals.append(lengths[i])
    return [sorted(g) for g in groups]


def balance(lengths: Sequence[int], ranks: int) -> list[list[int]]:
    """Indices into `lengths` split over `ranks` data-parallel ranks by tokens, not by count:
    longest first, each to the rank with the fewest tokens so far (ties: the lower rank)."""
    out: list[list[int]] = [[] for _ in range(ranks)]
    load = [0] * ranks
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = min(range(ranks), key=lambda r: (load[r], r))
        out[r].append(i)
        load[r] += lengths[i]
    return [sorted(x) for x in out]
