"""Sampling one token from a row of logits, as the torch and megatron engines both do."""
from __future__ import annotations

import torch

from kiln.services.rollout.engine import SamplingOptions


def logprobs_mode(settings) -> str:
    """What an engine's log-probs are of, for its fingerprint."""
    return "tempered" if settings.tempered_logprobs else "raw"


def tempered_logits(logits: torch.Tensor, sampling: SamplingOptions, tempered: bool) -> torch.Tensor:
    """The logits whose log-softmax is recorded: `logits / temperature` when `tempered` and the
    request samples (temperature > 0, not 1), else `logits` unchanged."""
    if tempered and sampling.temperature not in (0.0, 1.0):
        return logits / sampling.temperature
    return logits


def sample_token(logits: torch.Tensor, sampling: SamplingOptions, gen: torch.Generator,
                 tempered: bool = False) -> tuple[int, float]:
    """(token, its log-prob) sampled from one row of logits with vLLM's semantics: temperature
    0 is greedy, top-p keeps the smallest prefix of the sorted distribution whose mass reaches
    top_p. The log-prob is taken before either, or with `tempered` after the temperature (and
    still before top-p, which a tempered job does not use)."""
    logp = torch.log_softmax(tempered_logits(logits, sampling, tempered), dim=-1)
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
