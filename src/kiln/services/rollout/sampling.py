"""Sampling one token from a row of logits, as the torch and megatron engines both do."""
from __future__ import annotations

from typing import Sequence

import torch

from kiln.models.megatron_model import choice_logits
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


def tool_choice_row(logits: torch.Tensor, sampling: SamplingOptions,
                    generated: Sequence[int]) -> torch.Tensor | None:
    """The row a tool choice samples from after `generated` (this request's tokens so far), as
    vLLM's processor makes it (`tool_choice.py`, temperature applied; a greedy request's
    unscaled); None where the next token is no tool choice."""
    rule = sampling.tool_choice
    if rule is None or (found := rule.allowed(generated)) is None:
        return None
    allowed, temperature = found
    ids = torch.tensor(allowed, dtype=torch.long)
    if sampling.temperature == 0:  # greedy: the choice's tokens alone, unscaled
        return choice_logits(logits.float(), ids, 1.0, 1.0)
    return choice_logits(logits.float(), ids, sampling.temperature / temperature,
                         sampling.temperature)


def sample_choice(row: torch.Tensor, sampling: SamplingOptions,
                  gen: torch.Generator) -> tuple[int, float]:
    """(token, its log-prob) drawn from a tool choice's `row` (`tool_choice_row`): its argmax
    for a greedy request."""
    if sampling.temperature == 0:
        token = int(torch.argmax(row))
    else:
        token = int(torch.multinomial(torch.softmax(row, dim=-1), 1, generator=gen))
    return token, float(torch.log_softmax(row, dim=-1)[token])


def sample_token(logits: torch.Tensor, sampling: SamplingOptions, gen: torch.Generator,
                 tempered: bool = False, generated: Sequence[int] = ()) -> tuple[int, float]:
    """(token, its log-prob) sampled from one row of logits with vLLM's semantics: temperature
    0 is greedy, top-p keeps the smallest prefix of the sorted distribution whose mass reaches
    top_p. The log-prob is taken before either, or with `tempered` after the temperature (and
    still before top-p, which a tempered job does not use). A tool choice after `generated`
    (`SamplingOptions.tool_choice`) is sampled, and its log-prob taken, from its own row."""
    if (row := tool_choice_row(logits, sampling, generated)) is not None:
        return sample_choice(row, sampling, gen)
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
