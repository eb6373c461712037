"""The model-based parts of a task set's hybrid reward (`rewardRules.outcomeModel`,
`rewardRules.judge`, `src/kiln/api/rewards.py`), asked when an RL episode ends.

The sandbox service has already graded the episode and added its rules
(`src/kiln/services/sandbox/rules.py`); its StepResult carries the answer graded and the task's
reference answer. Here the frozen deployments of the job's reward models score it:

- the outcome model is asked `question` after the task and the answer, and its score is
  P(yes) / (P(yes) + P(no)) from the log-probs its Score RPC gives the two replies: one batched
  call of two sequences;
- the judge is prompted with the rubric, the task, the reference (when there is one) and the
  answer, and writes a verdict greedily through Generate after a prompt that ends in `SCORE:`;
  the verdict's final line must be `SCORE: n/10` (n in 0-10), and n/10 is its score. Any
  other verdict is unparsed: score 0, `judge/parsed` 0 and the counter
  `kiln_judge_verdicts_unparsed_total`, never a guess from the first number in it ("7 out of
  10 ... 2" is not a 0.7).

The answer is the policy's text, so it is the adversary's: every special or added token's
text in it (a literal `<|im_end|>`, a format's tags) is broken with a zero-width space before
it is rendered, so it reaches the reward model as plain text and cannot close the user's turn
or forge a verdict of the model's own.

Both prompts are rendered with the policy's own format (chat template or tags), so a reward
model must share the policy's tokenizer, as a distillation teacher must. Not covered: an answer
that talks the judge into a verdict in plain words (the rubric and the judge's training are the
defence there). Each score goes into
`reward_parts` (`orm`, `judge`) and, times its weight, into the reward. Evaluations and
demonstrations do not ask reward models: success is the verifier's.
"""
from __future__ import annotations

import dataclasses
import math
import re
import time
from typing import Awaitable, Callable

from kiln.api.rewards import Judge, OutcomeModel
from kiln.episode import EpisodeInfo, Message, StepResult
from kiln.services.common import metrics
from kiln.services.rollout.engine import Engine, SamplingOptions

#: Per-token log-probs of token sequences (a frozen deployment's Score).
Scorer = Callable[[list[list[int]]], Awaitable[list[list[float]]]]

_VERDICT = re.compile(r"SCORE:\s*(\d+(?:\.\d+)?)\s*/\s*10")
#: Inserted after the first character of a special token's text found in an answer.
_BREAK = "\u200b"


def task_text(info: EpisodeInfo) -> str:
    """The task as the policy was given it: its last user message."""
    users = [m.content for m in info.messages if m.role == "user"]
    return users[-1] if users else ""


# Short prompts: a reward model has the policy's context length, and a tiny one little else.
def orm_prompt(question: str, task: str, answer: str) -> str:
    return f"{task}\nAnswer: {answer}\n{question}"


def judge_prompt(rubric: str, task: str, answer: str, reference: str) -> str:
    anchor = f"Reference: {reference}\n" if reference else ""
    return (f"Grade the answer. {rubric}\n{task}\n{anchor}Answer: {answer}\n"
            "End with a line SCORE: n/10 (n from 0 to 10).\nSCORE:")


def parse_verdict(text: str) -> float | None:
    """n/10 from the verdict's last non-empty line when it is exactly `SCORE: n/10` with n in
    [0, 10]; else None (unparsed)."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    m = _VERDICT.fullmatch(lines[-1]) if lines else None
    if m is None:
        return None
    value = float(m.group(1))
    return value / 10.0 if 0.0 <= value <= 10.0 else None


def escape_special(text: str, tokenizer) -> str:
    """`text` with every special or added token's text broken by a zero-width space, so that
    encoding it yields none of those tokens."""
    specials = set(getattr(tokenizer, "all_special_tokens", []) or [])
    specials |= set((tokenizer.get_added_vocab() if hasattr(tokenizer, "get_added_vocab")
                     else {}).keys())
    specials = sorted((t for t in specials if len(t) > 1), key=len, reverse=True)
    changed = True
    while changed:  # a break can only remove matches; loop until none is left
        changed = False
        for token in specials:
            if token in text:
                text = text.replace(token, token[0] + _BREAK + token[1:])
                changed = True
    return text


def yes_probability(logp_yes: float, logp_no: float) -> float:
    """P(yes) among the two replies: a logistic of the log-prob difference (stable for any
    magnitudes; 0.5 when both are -inf)."""
    d = logp_yes - logp_no
    if math.isnan(d):
        return 0.5
    return 1.0 / (1.0 + math.exp(-d)) if d >= 0 else math.exp(d) / (1.0 + math.exp(d))


@dataclasses.dataclass
class RewardModels:
    """One task set's outcome model and judge, over their frozen deployments."""

    fmt: object
    """The policy's Format: renders prompts, encodes replies, decodes verdicts."""
    outcome: OutcomeModel | None = None
    scorer: Scorer | None = None
    judge: Judge | None = None
    judge_engine: Engine | None = None

    def _prompt(self, text: str) -> list[int]:
        conv = self.fmt.conversation(EpisodeInfo("reward-model", "", "", [Message("user", text)], []))
        return conv.prompt() + conv.action_prefix()

    def _encode(self, text: str) -> list[int]:
        return list(self.fmt.tokenizer.encode(text, add_special_tokens=False))

    async def orm_score(self, task: str, answer: str) -> float:
        answer = escape_special(answer, self.fmt.tokenizer)
        prompt = self._prompt(orm_prompt(self.outcome.question, task, answer))
        yes, no = self._encode(self.outcome.yes), self._encode(self.outcome.no)
        rows = await self.scorer([prompt + yes, prompt + no])
        return yes_probability(sum(rows[0][len(prompt):]), sum(rows[1][len(prompt):]))

    async def judge_score(self, task: str, answer: str, reference: str) -> tuple[float | None, str]:
        answer = escape_special(answer, self.fmt.tokenizer)
        prompt = self._prompt(judge_prompt(self.judge.rubric, task, answer, reference))
        gen = await self.judge_engine.generate(prompt, SamplingOptions(
            temperature=0.0, max_tokens=self.judge.max_tokens, seed=None,
            stop_token_ids=tuple(self.fmt.stop_token_ids)))
        # The prompt ends in "SCORE:": the verdict is read with it.
        verdict = "SCORE:" + self.fmt.tokenizer.decode(gen.token_ids, skip_special_tokens=True)
        return parse_verdict(verdict), verdict

    async def __call__(self, info: EpisodeInfo, result: StepResult) -> StepResult:
        """`result` (an ended episode's) with the models' weighted scores added."""
        task, parts, reward = task_text(info), dict(result.reward_parts), result.reward
        parts.setdefault("verifier", result.reward)
        t0 = time.perf_counter()
        if self.outcome is not None:
            parts["orm"] = await self.orm_score(task, result.answer)
            reward += self.outcome.weight * parts["orm"]
        if self.judge is not None:
            score, _ = await self.judge_score(task, result.answer, result.reference)
            parts["judge/parsed"] = float(score is not None)
            if score is None:
                metrics.JUDGE_UNPARSED.inc()
            parts["judge"] = score or 0.0
            reward += self.judge.weight * parts["judge"]
        metrics.REWARD_MODEL_SECONDS.observe(time.perf_counter() - t0)
        return dataclasses.replace(result, reward=reward, reward_parts=parts)
