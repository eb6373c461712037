"""A task set's rule-based reward components (`rewardRules`, `src/kiln/api/rewards.py`), scored on
a finished episode and added to its grade.

Each rule scores in [0, 1]; the reward becomes `verifierWeight * grade + sum(weight * score)`,
and every score is kept in the grade's parts as `rule/<name>` (the grade's own reward as
`verifier`), so the trajectory carries each component.
"""
from __future__ import annotations

import re

from kiln.api.rewards import RewardRule, RewardRules
from kiln.env import Grade


def rule_score(rule: RewardRule, answer: str | None, well_formed: bool) -> float:
    if rule.regex is not None:
        return float(answer is not None and re.search(rule.regex, answer) is not None)
    if rule.max_chars is not None:
        n = len(answer or "")
        return 1.0 if n <= rule.max_chars else rule.max_chars / n
    return float(well_formed)


def apply_rules(rules: RewardRules, grade: Grade, answer: str | None, well_formed: bool) -> Grade:
    """`grade` with the rules' weighted scores added to its reward and kept in its parts."""
    scores = {f"rule/{r.name}": rule_score(r, answer, well_formed) for r in rules.rules}
    reward = rules.verifier_weight * grade.reward + sum(
        r.weight * scores[f"rule/{r.name}"] for r in rules.rules)
    parts = {**grade.parts, "verifier": grade.parts.get("verifier", grade.reward), **scores}
    return Grade(reward, parts, grade.output, grade.flags)
