"""Sampling one token from a row of logits, as the torch and megatron engines both do."""
from __future__ import annotations

import torch

from kiln.services.rollout.engine import SamplingOptions


def sample_token(logits: torch.Tensor, sampling: SamplingOptions, gen: torch.Generator) -> tuple[int, float]:
    """(token, its log-prob under the raw distribution) sampled from one row of logits with
    vLLM's semantics: temperature 0 is greedy, top-p keeps the smallest prefix of the sorted
    distribution whose mass reaches top_p, and the log-prob is taken before either."""
    logp = torch.log_softmax(logits, dim=-1)
    if sampling.temperature == 0:
        token = int(torch.argmax(logits))
        return token, float(logp[token])
    probs = torch.softmax(logits / sampling.temperature, dim=-1)
    if sampling.top_p < 1:
        sorted_p, order = torch.sort(probs, descending=True, stable=True)
        keep = torch.cumsum(sorted_p, 0) - sorted_p < sampling.top_p  # always keeps the top one
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_p[keep])
    token = int(torch.multinomial(probs, 1, generator=gen))
    return token, float(logp[token])
