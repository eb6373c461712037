"""The hybrid reward of a task set (`spec.tasks[].rewardRules`): the verifier's grade, rules
(checks on the final answer and the episode's form), an outcome reward model and a generative
judge, each weighted and added up, each score kept on the trajectory (`reward_parts`:
`verifier`, `rule/<name>`, `orm`, `judge`). Torch-free. The sandbox service scores the rules
(`src/kiln/services/sandbox/rules.py`); rollout asks the models (`src/kiln/services/rollout/reward_models.py`),
each a frozen deployment of its own, served like a distillation teacher (a rollout pinned to a
checkpoint: an earlier stage's final weights or a checkpoint directory).
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


class OutcomeModel(Model):
    """An outcome reward model: a checkpoint asked whether the episode's final answer to the
    task is correct; its score is P(yes) / (P(yes) + P(no)) from the log-probs it gives the two
    replies (a language model used as a classifier, served for scoring only)."""

    model: str = Field(min_length=1)
    """An earlier stage's name (its final weights) or a checkpoint directory. It must share the
    policy's tokenizer."""
    weight: float = 1.0
    """Weight of its score (P(yes), in [0, 1]) in the reward."""
    question: str = Field("Is the answer correct? Reply yes or no.", min_length=1)
    """Asked after the task and the answer."""
    yes: str = Field("yes", min_length=1)
    """The reply that means correct."""
    no: str = Field("no", min_length=1)
    """The reply that means wrong."""


class Judge(Model):
    """A generative reward model: a checkpoint served by a rollout deployment, prompted with a
    rubric, the task, the answer and (where the task has one) a reference answer as an anchor;
    its verdict's final line `SCORE: n/10` gives the score n/10 (0 when the verdict has no such
    line: `judge/parsed` says which)."""

    model: str = Field(min_length=1)
    """An earlier stage's name (its final weights) or a checkpoint directory. It must share the
    policy's tokenizer."""
    weight: float = 1.0
    """Weight of its score (the verdict over 10, in [0, 1]) in the reward."""
    rubric: str = Field(min_length=1)
    """What a good answer is, in the judge's words."""
    max_tokens: int = Field(16, ge=1, le=1024)
    """Length of the verdict (greedy)."""


class RewardRules(Model):
    """The reward of a task set's episodes as a weighted sum: `verifierWeight` times the
    environment's grade (after the task set's custom reward, if any), plus each rule's weight
    times its score, plus the outcome model's and the judge's weights times theirs."""

    verifier_weight: float = 1.0
    """Weight of the environment's (or custom reward's) grade."""
    rules: list[RewardRule] = Field(default_factory=list)
    """The checks, each with its weight."""
    outcome_model: OutcomeModel | None = None
    """An outcome reward model asked whether the answer is correct."""
    judge: Judge | None = None
    """A generative judge that grades the answer against a rubric."""

    @model_validator(mode="after")
    def _unique(self) -> "RewardRules":
        names = [r.name for r in self.rules]
        if len(set(names)) != len(names):
            raise ValueError(f"rules: names must be unique, found {names}")
        if not self.rules and self.outcome_model is None and self.judge is None:
            raise ValueError("set at least one of rules, outcomeModel or judge")
        return self

    def models(self) -> list[str]:
        """The checkpoints (stage names or directories) this task set's reward asks."""
        return [m.model for m in (self.outcome_model, self.judge) if m is not None]
