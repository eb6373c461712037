"""Tool-choice sampling (`rollout.sampling.toolChoiceTemperature`) inside vLLM.

A request that carries a `ToolChoiceRule` samples the token right after each of its openings
from that opening's tokens alone, at that choice's temperature: after a call's opening, the
first tokens of the tools' names, at the tool-choice temperature; at the request's own, a
reply's first token (`<call>` or `<answer>`) and each further token of a call whose argument
is enumerated, among those that keep it a valid call. Every other token is
sampled as the request says. Why: a policy that imitated serial demonstrations
gives the tool it was never shown next a probability near 1e-9; a uniform temperature high
enough to raise it (about 6 in the swarm example) puts most of the mass on tokens that are no
tool name at all, so the calls break before the choice moves (benchmarks/swarm/exploration.py).

vLLM applies it as a custom logits processor (`ToolChoiceLogitsProcessor`, loaded by its
qualified name in every engine; requests opt in through `SamplingParams.extra_args`). It runs
before vLLM divides by the request's temperature T, so it scales the kept logits by T / Tc (Tc:
the choice's temperature): the row vLLM samples from, and whose log-softmax it records in
"processed_logprobs" mode, is softmax(logits / Tc) over the choice's tokens.
`kiln.models.megatron_model.choice_logits` computes that row with vLLM's float32 operations,
here, in the torch and megatron engines and in the trainer.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates

from kiln.models.megatron_model import choice_logits

if TYPE_CHECKING:
    from vllm import SamplingParams

#: The `SamplingParams.extra_args` key a request's rule travels under.
EXTRA_ARG = "kiln_tool_choice"


def extra_args(choices, request_temperature: float) -> dict[str, Any]:
    """What a request passes in `SamplingParams.extra_args` to sample its choices:
    `choices` is `ToolChoiceRule.choices`, ((opening, token ids, temperature), ...)."""
    # A greedy request takes the argmax among the choice's tokens: unscaled.
    return {EXTRA_ARG: {"choices": [
        [list(o), list(ids), request_temperature / t if request_temperature else 1.0]
        for o, ids, t in choices]}}


class ToolChoiceLogitsProcessor(LogitsProcessor):
    """Masks the row of a request whose last generated tokens are one of its choices' openings
    to that choice's tokens, scaled (see the module doc); the longest opening that matches
    wins. Not argmax-invariant: vLLM applies it before temperature, to every row it tracks, so
    a greedy request takes the argmax among the choice's tokens."""

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self.device = device
        # Batch row -> (its choices, longest opening first, with their scales; the request's
        # running output).
        self.rows: dict[int, tuple[list[tuple[tuple[int, ...], torch.Tensor, float]], list[int]]] = {}

    @classmethod
    def validate_params(cls, params: "SamplingParams") -> None:
        spec = (params.extra_args or {}).get(EXTRA_ARG)
        if spec is None:
            return
        choices = spec.get("choices") or []
        if not choices or not all(ids and scale > 0 for _, ids, scale in choices):
            raise ValueError(f"extra_args[{EXTRA_ARG!r}] needs choices (an opening, token ids "
                             f"and a positive scale each); got {spec!r}")

    def is_argmax_invariant(self) -> bool:
        return False

    def _new(self, params: "SamplingParams", _prompt: list[int] | None, output: list[int]):
        spec = (params.extra_args or {}).get(EXTRA_ARG)
        if spec is None:
            return None
        choices = sorted(((tuple(o), torch.tensor(ids, dtype=torch.long, device=self.device),
                           float(scale)) for o, ids, scale in spec["choices"]),
                         key=lambda c: -len(c[0]))
        return choices, output

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.rows, batch_update, self._new)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for row, (choices, output) in self.rows.items():
            for opening, ids, scale in choices:
                n = len(opening)
                # An empty opening is the request's first token.
                if (tuple(output[-n:]) == opening) if n else not output:
                    logits[row] = choice_logits(logits[row], ids, scale, 1.0)
                    break
        return logits
