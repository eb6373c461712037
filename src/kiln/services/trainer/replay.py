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

from kiln.models import moe, packing
from kiln.models.megatron_model import ToolChoices, token_and_topk_logprobs, token_logprobs
from kiln.routing import RoutedExperts
from kiln.services.trainer.batch import TensorBatch, collate_routing


def routed_logprobs(model, tokens: torch.Tensor, lengths: list[int], routing: torch.Tensor | None,
                    covered: torch.Tensor | None, mode: str) -> tuple[torch.Tensor, moe.RoutingFlips]:
    """`token_logprobs` of right-padded `tokens` [B, S] under routing `mode`, with the recorded
    `routing` [B, S, layers, topk] where `covered` [B, S]; and the flips counted."""
    logp, _, flips = _routed(model, tokens, lengths, routing, covered, mode, None, 1.0, None)
    return logp, flips


def _routed(model, tokens, lengths, routing, covered, mode, topk_ids, temperature, choices, predicts=None):
    def forward():
        if topk_ids is None:
            return token_logprobs(model, tokens, temperature, choices), None
        return token_and_topk_logprobs(model, tokens, topk_ids, temperature, choices)

    if routing is None or mode == "off" or not moe.is_moe_model(model):
        return (*forward(), moe.RoutingFlips())
    if predicts is None:
        positions = torch.arange(tokens.shape[1], device=tokens.device)[None]
        predicts = positions < torch.tensor(lengths, device=tokens.device)[:, None] - 1
    with moe.replay_routing(model, routing, covered & predicts, apply=mode == "replay") as flips:
        logp, topk = forward()
    return logp, topk, flips


def batch_logprobs(model, mb: TensorBatch, mode: str, *, topk: bool = False, temperature: float = 1.0
                   ) -> tuple[torch.Tensor, moe.RoutingFlips, torch.Tensor | None]:
    """`routed_logprobs` of a training micro-batch at the rollout's sampling `temperature`
    (and its tool choices' where the batch has some); with `topk` and a batch that carries a
    teacher's top k, also the student's log-probs of those tokens `[B, S, K]` (else None)."""
    ids = mb.topk_ids if topk else None
    logp, student_topk, flips = _routed(model, mb.tokens, mb.lengths, mb.routing,
                                        mb.routing_valid, mode, ids, temperature, mb.choices)
    return logp, flips, student_topk


def packed_batch_logprobs(model, mb: TensorBatch, mode: str, *, topk: bool = False,
                          temperature: float = 1.0
                          ) -> tuple[torch.Tensor, moe.RoutingFlips, torch.Tensor | None]:
    """`batch_logprobs` with the micro-batch's sequences packed into one row
    (`kiln.models.packing`): the same `[B, S]` results (and `[B, S, K]` top k), so the loss,
    its masks and its aggregation read them exactly as they read the padded path's; only the
    forward pass changes shape. Everything the forward reads per token (tokens, recorded
    routing, the teacher's top-k ids, tool choices) is packed the same way."""
    device = mb.tokens.device
    lengths = mb.lengths
    b, s = mb.tokens.shape
    rows = torch.cat([torch.full((n,), i, dtype=torch.long, device=device) for i, n in enumerate(lengths)])
    cols = packing.positions(lengths, device)
    one = lambda t: t[rows, cols][None] if t is not None else None  # noqa: E731
    ids = one(mb.topk_ids) if topk else None
    choices = None
    if mb.choices is not None and len(mb.choices.rows):
        offsets = torch.tensor([0, *lengths], device=device).cumsum(0)[:-1]
        c = mb.choices
        choices = ToolChoices(torch.zeros_like(c.rows), offsets[c.rows] + c.cols, c.ids, c.temperature)
    predicts = (cols < torch.tensor(lengths, device=device)[rows] - 1)[None]
    with packing.packed(model, lengths):
        logp_1T, topk_1TK, flips = _routed(model, one(mb.tokens), [len(rows)], one(mb.routing),
                                           one(mb.routing_valid), mode, ids, temperature, choices,
                                           predicts=predicts)
    # Back to [B, S]. A sequence's first position predicts nothing: 0, as in the padded path
    # (packed, it would hold the previous sequence's last token's prediction).
    keep = cols > 0
    logp = logp_1T.new_zeros(b, s).index_put((rows[keep], cols[keep]), logp_1T[0][keep])
    student_topk = None
    if topk_1TK is not None:
        student_topk = topk_1TK.new_zeros(b, s, topk_1TK.shape[-1]).index_put(
            (rows[keep], cols[keep]), topk_1TK[0][keep])
    return logp, flips, student_topk


def score(model, tokens: torch.Tensor, lengths: list[int], routed: list[RoutedExperts | None],
          micro_batch_size: int, mode: str) -> tuple[list[list[float]], moe.RoutingFlips]:
    """Per-token log-probs of right-padded `tokens` ([B, S] on the model's device) with each
    sequence's `routed` experts under `mode`, micro-batch by micro-batch; and the flips."""
    routing, covered = collate_routing(routed, tokens.shape[1])
    if routing is not None:
        routing, covered = routing.to(tokens.device), covered.to(tokens.device)
    total = moe.RoutingFlips()
    out: list[list[float]] = []
    for i in range(0, len(lengths), micro_batch_size):
        rows, part = slice(i, i + micro_batch_size), lengths[i : i + micro_batch_size]
        n = max(part)
        logp, flips = routed_logprobs(model, tokens[rows, :n], part,
                                      routing[rows, :n] if routing is not None else None,
                                      covered[rows, :n] if covered is not None else None, mode)
        total.flips += flips.flips
        total.compared += flips.compared
        out.extend(row[:length].tolist() for row, length in zip(logp.cpu(), part))
    return out, total
