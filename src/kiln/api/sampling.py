"""How rollout samples actions: the RLJob's `spec.rollout.sampling`.

Part of the RLJob API; `kiln.api.spec` assembles the job from these and is the module to import.
"""
from __future__ import annotations

from pydantic import Field, model_validator

from kiln.api.base import Model

VLLM_MAX_TEMPERATURE = 2.0
"""vLLM refuses a request sampling hotter than this."""


class SamplingSpec(Model):
    """How rollout samples actions."""

    temperature: float = Field(1.0, ge=0)
    """Sampling temperature; 0 is greedy. vLLM refuses more than 2 (the megatron engine does
    not), so a job on vLLM is refused one before it starts. Each sampled token's log-prob is
    recorded under the distribution it was drawn from, softmax(logits / temperature) (greedy:
    the raw logits), and the trainer computes the same, so the importance ratios and masks of
    an RL stage compare the policy that acted. A teacher's scores (opd, klCoef) stay at
    temperature 1."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling: sample from the smallest set of tokens whose probability reaches topP.
    Log-probs are taken before it (the trainer does not truncate); so with a temperature other
    than 0 or 1 it must be 1."""
    tool_choice_temperature: float | None = Field(None, gt=0, le=100)
    """Explore which tool to call, and with which of its enumerated arguments, without heating
    anything else. The token that names the tool in a call (the first after the format's call
    opening) is sampled at this temperature from the first tokens of the tools' names alone.
    Where a tool's schema enumerates its argument's values (`enum`), every later token of its
    call is sampled, at `temperature`, among those that keep it one of the schema's calls (the
    value, then the closing tag); so is a reply's first token, among the format's openings.
    The rest of the reply is sampled at `temperature`. Why: a policy imitating demonstrations
    that always call the same tool next leaves the others no probability a uniform temperature
    can raise before it breaks the call's syntax; this one cannot break it.
    The trajectory records which tokens were such choices, and the trainer computes the same
    distribution there, so RL trains the policy that acted. Greedy evaluation takes the argmax
    among the same tokens. Frozen swarm subagents sample without it. Needs a sampling
    temperature above 0 and toolCallFormat `tags`. Unset: tools are chosen like any
    other token."""
    max_tokens_per_turn: int = Field(256, ge=1)
    """Tokens one action (a think block plus a tool call or an answer) may take."""
    max_total_tokens: int = Field(1024, ge=16)
    """Prompt, actions and observations together; the episode ends when it is reached."""

    @property
    def tempered(self) -> bool:
        """Whether log-probs are of softmax(logits / temperature) rather than of the raw logits."""
        return self.temperature not in (0.0, 1.0)

    @property
    def processed_logprobs(self) -> bool:
        """Whether rollout records log-probs of the distribution each token was drawn from
        (tempered, or a tool choice's) rather than of the raw logits."""
        return self.tempered or self.tool_choice_temperature is not None

    @model_validator(mode="after")
    def _top_p_with_temperature(self) -> "SamplingSpec":
        # vLLM's log-probs of a tempered distribution come after nucleus truncation too, which
        # the trainer cannot reproduce: the ratios would be off by the truncated mass.
        if self.tempered and self.top_p < 1:
            raise ValueError(f"topP={self.top_p} with temperature={self.temperature}: with a "
                             "temperature other than 0 or 1, topP must be 1 (log-probs are "
                             "recorded at the temperature, and the trainer does not truncate)")
        if self.tool_choice_temperature is not None and self.top_p < 1:
            raise ValueError(f"topP={self.top_p} with toolChoiceTemperature: topP must be 1 (log-probs "
                             "are recorded as sampled, and the trainer does not truncate)")
        return self
