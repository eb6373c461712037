"""How a training step's rows become forward passes: which rows a data-parallel replica takes,
how they are grouped into micro-batches (padded, or packed by a token budget:
`trainer.maxTokensPerMicroBatch`, `kiln.models.packing`), the log-probs of one micro-batch,
and which tokens routing replay must leave out of the loss.

Both layouts hand the loss the same `[B, S]` tensors (`replay.packed_batch_logprobs` unpacks
its results), so the masks, advantages and aggregation downstream do not know which was used.
"""
from __future__ import annotations

import torch

from kiln.models import packing
from kiln.routing import straddled_positions
from kiln.services.trainer.batch import TensorBatch
from kiln.services.trainer.replay import batch_logprobs, packed_batch_logprobs
from kiln.trajectory import Trajectory


def replica_rows(part: torch.Tensor, lengths: list[int], dp: int, dp_rank: int,
                 budget: int | None) -> torch.Tensor:
    """This data-parallel replica's rows of a minibatch `part`: every dp-th row, or, packing,
    a share balanced by tokens (`packing.balance`: every replica derives the same split)."""
    if budget is None or dp == 1:
        return part[dp_rank::dp]
    shares = packing.balance([lengths[i] for i in part.tolist()], dp)
    return part[torch.tensor(shares[dp_rank], dtype=torch.long)]


def split(rows: torch.Tensor, lengths: list[int], micro_batch_size: int,
          budget: int | None) -> list[torch.Tensor]:
    """`rows` in micro-batches: `micro_batch_size` sequences each, or, with a token `budget`,
    groups of at most that many tokens (`packing.plan`)."""
    if not len(rows):
        return []
    if budget is None:
        return list(torch.split(rows, micro_batch_size))
    groups = packing.plan([lengths[i] for i in rows.tolist()], budget)
    return [rows[torch.tensor(g, dtype=torch.long)] for g in groups]


def logprobs(model, mb: TensorBatch, routing_replay: str, budget: int | None, *, topk: bool = False,
             temperature: float = 1.0):
    """The micro-batch's log-probs (`replay.batch_logprobs`), its sequences packed into one row
    when packing (`replay.packed_batch_logprobs`: the same results, less padding)."""
    fn = batch_logprobs if budget is None else packed_batch_logprobs
    return fn(model, mb, routing_replay, topk=topk, temperature=temperature)


@torch.no_grad()
def start_of_step_logprobs(model, tb: TensorBatch, micro_batch_size: int, budget: int | None,
                           routing_replay: str, temperature: float) -> torch.Tensor:
    """`[B, S]` log-probs of the whole batch under the weights before the step's first update
    (`logp_train_old` when a step takes several updates), micro-batch by micro-batch, in eval
    mode (the caller sets train mode again)."""
    model.eval()
    out = torch.zeros_like(tb.logp_infer)
    for idx in split(torch.arange(tb.tokens.shape[0]), tb.lengths, micro_batch_size, budget):
        mb = tb.select(idx)
        out[idx, : mb.tokens.shape[1]] = logprobs(model, mb, routing_replay, budget, temperature=temperature)[0]
    return out


def mask_straddled_routing(batch: list[Trajectory], tb: TensorBatch) -> float | None:
    """With routing replayed, take out of the loss every token whose recorded routing is not
    the one it was sampled under (`kiln.routing.straddled_positions`: the weights changed
    inside its generation): replaying newer routing would score it under a policy that never
    sampled it. Returns the fraction of trainable tokens taken out, or None when no trajectory
    carries versioned routing."""
    if not any(t.routed_experts is not None and t.routed_experts.versions for t in batch):
        return None
    trainable = float(tb.loss_mask.sum())
    for i, t in enumerate(batch):
        positions = straddled_positions(t.routed_experts, t.version_spans)
        if positions:
            tb.loss_mask[i, positions] = 0.0
    return (trainable - float(tb.loss_mask.sum())) / trainable
