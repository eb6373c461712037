"""Rule-based reward components: each rule's score by hand, the weighted sum, the spec's errors,
and the episode manager adding them to a chain episode's grade (no sandbox: the answers here
call no tool)."""
from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from pydantic import ValidationError

from kiln.api.rewards import RewardRule, RewardRules
from kiln.env import Grade
from kiln.services.sandbox.rules import apply_rules, rule_score


def test_each_rule_scores_by_hand() -> None:
    digits = RewardRule(name="digits", regex=r"^[0-9]+$")
    short = RewardRule(name="short", maxChars=4)
    form = RewardRule(name="form", wellFormed=True)
    assert [rule_score(digits, a, True) for a in ("45", "4 5", None)] == [1.0, 0.0, 0.0]
    assert [rule_score(short, a, True) for a in ("1234", "12345678", None)] == [1.0, 0.5, 1.0]
    assert [rule_score(form, "1", w) for w in (True, False)] == [1.0, 0.0]


def test_weighted_sum_keeps_every_part() -> None:
    rules = RewardRules(verifierWeight=0.5, rules=[RewardRule(name="digits", regex=r"\d", weight=0.25),
                                                   RewardRule(name="short", maxChars=2, weight=-1)])
    out = apply_rules(rules, Grade(1.0, {"correct": 1.0}, "ok"), "1234", True)
    assert out.reward == pytest.approx(0.5 * 1.0 + 0.25 * 1.0 - 1 * 0.5)
    assert out.parts == {"correct": 1.0, "verifier": 1.0, "rule/digits": 1.0, "rule/short": 0.5}
    assert out.output == "ok"


@pytest.mark.parametrize("rule, message", [
    ({"name": "x"}, "exactly one of regex, maxChars or wellFormed (found none)"),
    ({"name": "x", "regex": "a", "maxChars": 3}, "found regex, max_chars"),
    ({"name": "x", "regex": "("}, "does not compile"),
    ({"name": "x", "wellFormed": False}, "wellFormed takes true only"),
])
def test_bad_rules_are_named(rule, message) -> None:
    with pytest.raises(ValidationError, match=message.replace("(", r"\(").replace(")", r"\)")):
        RewardRule.model_validate(rule)
    with pytest.raises(ValidationError, match="names must be unique"):
        RewardRules.model_validate({"rules": [{"name": "a", "regex": "1"}, {"name": "a", "regex": "2"}]})


def test_episode_grade_carries_the_rules(tmp_path: Path) -> None:
    from kiln.api.spec import RLJob
    from kiln.episode import Action
    from kiln.services.sandbox.episodes import EpisodeManager

    job = RLJob.model_validate({
        "apiVersion": "kiln.dev/v1alpha1", "kind": "RLJob", "metadata": {"name": "rules"},
        "spec": {"model": {"path": "m"},
                 "tasks": [{"name": "c", "env": "chain", "generate": {"count": 2},
                            "rewardRules": {"verifierWeight": 1.0, "rules": [
                                {"name": "digits", "regex": "^[0-9]+$", "weight": 0.1},
                                {"name": "form", "wellFormed": True, "weight": 0.2}]}}],
                 "stages": [{"name": "rl", "type": "rl", "tasks": ["c"]}]}})
    episodes = EpisodeManager(job, base_dir=tmp_path, owner="rules-test")
    answer = str(episodes.task("c", 0).answer)

    async def play(*replies: Action):
        info = episodes.open("c", 0)
        for reply in replies:
            result = await episodes.step(info.episode_id, reply)
        return result

    right = asyncio.run(play(Action(content=answer)))
    assert right.done and right.reward == pytest.approx(1.0 + 0.1 + 0.2)
    assert right.reward_parts["verifier"] == 1.0
    assert (right.reward_parts["rule/digits"], right.reward_parts["rule/form"]) == (1.0, 1.0)
    # An unreadable reply ends a chain episode: no answer, and not well formed.
    garbled = asyncio.run(play(Action(unparseable=True, problem="garbled")))
    assert garbled.done and garbled.reward == 0.0
    assert (garbled.reward_parts["rule/digits"], garbled.reward_parts["rule/form"]) == (0.0, 0.0)
    wrong = asyncio.run(play(Action(content="no")))
    assert wrong.reward == pytest.approx(0.0 + 0.0 + 0.2)


def test_a_backtracking_regex_times_out_off_the_event_loop(monkeypatch) -> None:
    """`^(a|aa)+$` against 60 a's and a b backtracks for hours: the rule scores 0 after its
    time limit, the grade says so, and the event loop keeps running meanwhile."""
    from kiln.services.sandbox import rules as rules_mod
    monkeypatch.setattr(rules_mod, "REGEX_TIMEOUT_S", 0.3)
    rules = RewardRules(rules=[RewardRule(name="evil", regex=r"^(a|aa)+$", weight=1.0),
                               RewardRule(name="ok", regex=r"b$", weight=1.0)])

    async def go():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        t = asyncio.ensure_future(ticker())
        grade = await asyncio.to_thread(apply_rules, rules, Grade(1.0), "a" * 60 + "b", True)
        t.cancel()
        return grade, ticks

    grade, ticks = asyncio.run(go())
    assert grade.parts["rule/evil"] == 0.0 and grade.parts["rule/ok"] == 1.0
    assert rules_mod.RULE_TIMEOUT_FLAG in grade.flags
    assert ticks >= 10  # ~30 expected in 0.3 s; a held GIL would give 0 or 1
