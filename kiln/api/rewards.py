"""Rule-based reward components of a task set (`spec.tasks[].rewardRules`): checks on the final
answer and the episode's form, each weighted and added to the verifier's reward, each score
kept on the trajectory (`reward_parts["rule/<name>"]`). Torch-free; the sandbox service scores
them (`services/sandbox/rules.py`).

Not covered: model-based components (an outcome reward model, a judge).
"""
from __future__ import annotations

import re

from pydantic import Field, model_validator

from kiln.api.components import Model


class RewardRule(Model):
    """One check, scored in [0, 1]: exactly one of `regex`, `maxChars` or `wellFormed`."""

    name: str = Field(pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", max_length=63)
    """Name of the component (its score is `reward_parts["rule/<name>"]`)."""
    weight: float = 1.0
    """Weight of the score in the reward (negative: a penalty for passing the check)."""
    regex: str | None = None
    """1 if the final answer contains a match of this Python regular expression, else 0."""
    max_chars: int | None = Field(None, ge=1)
    """1 if the final answer has at most this many characters, else maxChars / its length."""
    well_formed: bool | None = None
    """true: 1 if every reply of the episode could be read (tool calls or an answer) and it
    ended with an answer, else 0."""

    @model_validator(mode="after")
    def _one_check(self) -> "RewardRule":
        given = [k for k in ("regex", "max_chars", "well_formed") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"rule {self.name!r}: set exactly one of regex, maxChars or "
                             f"wellFormed (found {', '.join(given) or 'none'})")
        if self.regex is not None:
            try:
                re.compile(self.regex)
            except re.error as exc:
                raise ValueError(f"rule {self.name!r}: regex {self.regex!r} does not compile: "
                                 f"{exc}") from None
        if self.well_formed is False:
            raise ValueError(f"rule {self.name!r}: wellFormed takes true only")
        return self


class RewardRules(Model):
    """The reward of a task set's episodes as a weighted sum: `verifierWeight` times the
    environment's grade (after the task set's custom reward, if any) plus each rule's weight
    times its score."""

    verifier_weight: float = 1.0
    """Weight of the environment's (or custom reward's) grade."""
    rules: list[RewardRule] = Field(min_length=1)
    """The checks, each with its weight."""

    @model_validator(mode="after")
    def _unique(self) -> "RewardRules":
        names = [r.name for r in self.rules]
        if len(set(names)) != len(names):
            raise ValueError(f"rules: names must be unique, found {names}")
        return self
