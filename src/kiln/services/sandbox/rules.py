"""A task set's rule-based reward components (`rewardRules`, `src/kiln/api/rewards.py`), scored on
a finished episode and added to its grade.

Each rule scores in [0, 1]; the reward becomes `verifierWeight * grade + sum(weight * score)`,
and every score is kept in the grade's parts as `rule/<name>` (the grade's own reward as
`verifier`), so the trajectory carries each component.

A regex is the job author's and the answer the model's: together they can backtrack for
hours. Patterns run on the `regex` engine with a time limit (`REGEX_TIMEOUT_S`) and with the
GIL released, and the caller runs `apply_rules` in a thread, so a slow match never holds the
service's event loop; a match that runs out of time scores 0 and flags the grade
`rule_timeout`.
"""
from __future__ import annotations

import logging

import regex

from kiln.api.rewards import RewardRule, RewardRules
from kiln.env import Grade

log = logging.getLogger(__name__)

#: Seconds one regex rule may take on one answer.
REGEX_TIMEOUT_S = 1.0
#: Grade flag of an episode one of whose regex rules ran out of time.
RULE_TIMEOUT_FLAG = "rule_timeout"


class RuleTimeout(Exception):
    """A regex rule ran out of time on this answer."""


def rule_score(rule: RewardRule, answer: str | None, well_formed: bool) -> float:
    if rule.regex is not None:
        if answer is None:
            return 0.0
        try:
            found = regex.search(rule.regex, answer, timeout=REGEX_TIMEOUT_S, concurrent=True)
        except TimeoutError:
            raise RuleTimeout(rule.name) from None
        return float(found is not None)
    if rule.max_chars is not None:
        n = len(answer or "")
        return 1.0 if n <= rule.max_chars else rule.max_chars / n
    return float(well_formed)


def apply_rules(rules: RewardRules, grade: Grade, answer: str | None, well_formed: bool) -> Grade:
    """`grade` with the rules' weighted scores added to its reward and kept in its parts."""
    scores, flags = {}, list(grade.flags)
    for r in rules.rules:
        try:
            scores[f"rule/{r.name}"] = rule_score(r, answer, well_formed)
        except RuleTimeout:
            log.warning("reward rule %r: regex ran out of time (%.1f s); scored 0", r.name,
                        REGEX_TIMEOUT_S)
            scores[f"rule/{r.name}"] = 0.0
            if RULE_TIMEOUT_FLAG not in flags:
                flags.append(RULE_TIMEOUT_FLAG)
    reward = rules.verifier_weight * grade.reward + sum(
        r.weight * scores[f"rule/{r.name}"] for r in rules.rules)
    parts = {**grade.parts, "verifier": grade.parts.get("verifier", grade.reward), **scores}
    return Grade(reward, parts, grade.output, flags)
