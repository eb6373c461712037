"""MoE routing replay in the trainer's forward passes.

A trajectory from an MoE model carries the experts rollout chose for its positions
(`kiln.routing.RoutedExperts`, collated by `batch.collate_routing`). Per the job's
`model.routingReplay`:
- `replay`: the forward uses those experts where they were recorded, the router's own top-k
  elsewhere (`kiln.models.moe.replay_routing`); the gate is still trained;
- `record`: the router's own top-k everywhere, compared with the recorded one;
- `off`: nothing recorded is read.
Either of the first two counts routing flips: (token, layer) pairs whose trainer top-k differs
from rollout's, over positions that predict a token (a sequence's last position does not), which
the step reports as `routing_flip_frac`.
"""
from __future__ import annotations

import torch

from kiln.models import moe
from kiln.models.megatron_model import token_logprobs
from kiln.routing import RoutedExperts
from kiln.services.trainer.batch import TensorBatch, collate_routing


def routed_logprobs(model, mb: TensorBatch, mode: str) -> tuple[torch.Tensor, moe.RoutingFlips]:
    """`token_logprobs` of a micro-batch under routing `mode`, and the flips counted."""
    if mb.routing is None or mode == "off" or not moe.is_moe_model(model):
        return token_logprobs(model, mb.tokens), moe.RoutingFlips()
    positions = torch.arange(mb.tokens.shape[1], device=mb.tokens.device)[None]
    predicts = positions < torch.tensor(mb.lengths, device=mb.tokens.device)[:, None] - 1
    with moe.replay_routing(model, mb.routing, mb.routing_valid & predicts, apply=mode == "replay") as flips:
        logp = token_logprobs(model, mb.tokens)
    return logp, flips


def score(model, tokens: torch.Tensor, lengths: list[int], routed: list[RoutedExperts | None],
          micro_batch_size: int, mode: str) -> tuple[list[list[float]], moe.RoutingFlips]:
    """Per-token log-probs of right-padded `tokens` ([B, S] on the model's device) with each
    sequence's `routed` experts under `mode`, micro-batch by micro-batch; and the flips."""
    routing, valid = collate_routing(routed, tokens.shape[1])
    total = moe.RoutingFlips()
    out: list[list[float]] = []
    for i in range(0, len(lengths), micro_batch_size):
        part = lengths[i : i + micro_batch_size]
        n = max(part)
        mb = TensorBatch(
            tokens=tokens[i : i + micro_batch_size, :n], loss_mask=None, logp_infer=None, advantages=None,
            teacher_logp=None, has_teacher=None, lengths=part,
            routing=routing[i : i + micro_batch_size, :n].to(tokens.device) if routing is not None else None,
            routing_valid=valid[i : i + micro_batch_size, :n].to(tokens.device) if valid is not None else None)
        logp, flips = routed_logprobs(model, mb, mode)
        total.flips += flips.flips
        total.compared += flips.compared
        out.extend(row[:length].tolist() for row, length in zip(logp.cpu(), part))
    return out, total
