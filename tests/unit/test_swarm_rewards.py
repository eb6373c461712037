"""Agent swarms' PARL reward: r_parallel paid always, by outcome or for the subagents whose
answers were read, r_finish, the critical-path budget and its annealing, the shaping terms
credited to the replies that started subagents, and the job settings that choose them (bad
ones named).

The episodes are real `wide` episodes (sub-tasks' shell calls in bubblewrap sandboxes, the tags
format, a trained tokenizer) played by scripted policies (`helpers/swarm.py`), so that each
test knows how many subagents ran at once, were read and finished, and can check the reward
against it by hand."""
from __future__ import annotations

import asyncio
import re

import pytest
from pydantic import ValidationError

from kiln.api.spec import RLJob
from kiln.services.rollout.engine import SamplingOptions
from kiln.swarm import Parl, annealed

from helpers.swarm import (EPISODE, WIDTH, Scripted, episode_manager, job_doc, orchestrator,
                           parallel, play, serial, swarm_producer, train_swarm_tokenizer)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return train_swarm_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture()
def manager(tmp_path):
    return episode_manager(tmp_path)


def test_collected_r_parallel_counts_only_subagents_whose_answers_were_read(manager, tok):
    collected = Parl(0.5, 0.5, WIDTH, paid="collected")
    # All three assigned, then an answer without a wait: three ran at once, none was read.
    blind_script = parallel(manager)[:-2] + ["<answer>10 11 12</answer>"]
    blind, _ = play(manager, tok, blind_script, parl=collected)
    assert blind.reward_parts["swarm/peak_parallel"] == WIDTH
    assert blind.reward_parts["swarm/peak_parallel_collected"] == 0
    assert blind.reward_parts["parl/parallel"] == 0.0
    assert blind.reward_parts["parl/finish"] == 0.0  # none of its sub-tasks reached it
    assert blind.reward == pytest.approx(blind.reward_parts["parl/perf"])
    # PARL as stated pays the same episode r_parallel in full.
    paid, _ = play(manager, tok, blind_script)
    assert paid.reward_parts["parl/parallel"] == 1.0
    assert paid.reward == pytest.approx(0.5 + paid.reward_parts["parl/perf"])
    # Two side by side, one of them read: one counts.
    half, _ = play(manager, tok, ["<call>assign next</call>", "<call>assign next</call>",
                                  "<call>wait s1</call>", "ANSWER"], parl=collected)
    assert half.reward_parts["swarm/peak_parallel"] == 2
    assert half.reward_parts["swarm/peak_parallel_collected"] == 1
    assert half.reward_parts["parl/parallel"] == pytest.approx(1 / WIDTH)
    # All three read after one wait: the same as `always`.
    many, _ = play(manager, tok, parallel(manager), parl=collected)
    assert many.reward_parts["swarm/peak_parallel_collected"] == WIDTH
    assert many.reward == pytest.approx(0.5 + 0.5 + 1.0)


def test_a_critical_path_budget_ends_a_serial_episode_before_its_late_answer(manager, tok):
    # The parallel schedule's path (WIDTH + 4) as the budget: it answers within it.
    many, _ = play(manager, tok, parallel(manager), budget=WIDTH + 4)
    assert many.reward_parts["parl/perf"] == 1.0 and many.reward_parts["swarm/over_budget"] == 0.0
    # Serial: after the second wait its context is 8 deep, so its next call would be the 9th
    # step on the path; it ends there, after its second wait, with no answer.
    one, _ = play(manager, tok, serial(manager), budget=WIDTH + 4)
    assert one.reward_parts["parl/perf"] == 0.0
    assert one.reward_parts["swarm/over_budget"] == 1.0
    assert "critical_path_budget" in one.flags
    trained = tok.decode([x for x, m in zip(one.tokens, one.loss_mask) if m], skip_special_tokens=False)
    assert trained == "".join(serial(manager)[:4])
    assert one.reward_parts["swarm/critical_path_steps"] == 8
    # PARL's shaping terms still pay what the episode did.
    assert one.reward_parts["parl/finish"] == 1.0
    assert one.reward == pytest.approx(0.5 / WIDTH + 0.5)
    # Without a budget the same script answers, late.
    late, _ = play(manager, tok, serial(manager))
    assert late.reward_parts["parl/perf"] == 1.0 and late.reward_parts["swarm/over_budget"] == 0.0


def test_the_shaping_terms_are_credited_to_the_assignments_that_started_subagents(manager, tok):
    # Two assignments started subagents, a third was refused past the limit; then a wait and
    # an answer (two ends of three: wrong). Only the two assigning replies earned the shaping
    # terms; the refusal, the wait and the answer answer to the outcome alone.
    script = ["<call>assign 1</call>", "<call>assign 2</call>", "<call>assign 3</call>",
              "<call>wait all</call>", "ANSWER"]
    t, _ = play(manager, tok, script, max_subagents=2, credit="assignments")
    t.check()
    marked = tok.decode([x for x, m in zip(t.tokens, t.shaping_mask) if m], skip_special_tokens=False)
    assert marked == "<call>assign 1</call><call>assign 2</call>"
    parts = t.reward_parts
    assert parts["parl/perf"] == 0.0
    # 0.5 x r_parallel (2 of a target of 3 at once) + 0.5 x r_finish (2 done of 3 asked for).
    assert t.shaping_reward == pytest.approx(0.5 * 2 / 3 + 0.5 * 2 / 3) == t.reward - parts["parl/perf"]
    whole, _ = play(manager, tok, script, max_subagents=2)
    assert (whole.shaping_mask, whole.shaping_reward) == ([], 0.0)
    # The producer takes the job's setting, for training and evaluation alike.
    doc = job_doc(subagents="subagents", shapingCredit="assignments")
    producer = swarm_producer(manager, tok, Scripted(tok, orchestrator(serial(manager))),
                              RLJob.model_validate(doc).spec.stages[1].swarm)
    t = asyncio.run(producer._episode("swarm", rescore=True, task_set="wide", index=0,
                                      sampling=SamplingOptions(), limits=EPISODE))[0]
    marked = tok.decode([x for x, m in zip(t.tokens, t.shaping_mask) if m], skip_special_tokens=False)
    assert marked == "".join(f"<call>assign {k}</call>" for k in range(1, WIDTH + 1))
    # Replies are found in the episode's one context: a job that splits it is refused.
    doc["spec"]["rollout"] = {"thinking": "turn-level", "toolCallFormat": "hermes"}
    with pytest.raises(ValidationError, match=re.escape(
            "swarm.shapingCredit 'assignments' marks replies in the episode's one context")):
        RLJob.model_validate(doc)


def test_the_stage_pays_annealed_lambdas_as_its_steps_go_by(manager, tok):
    """The producer plays each training episode with PARL's weights where the stage's schedule
    puts them at the step it is at (its policy version less the stage's first): both lambdas
    at full weight until annealStart, then falling linearly to 0 at annealEnd, and the reward
    paid with those weights. Without annealEnd they reach 0 at the stage's maxSteps."""
    from kiln.services.rollout.producer import EXPLORE, Mode

    doc = job_doc(subagents="subagents", lambdaParallel=0.2, lambdaFinish=0.4, annealStart=2,
                  annealEnd=6)
    engine = Scripted(tok, orchestrator(["<call>assign 1</call>", "<call>wait all</call>",
                                         "<answer>0</answer>"]), version=10)
    producer = swarm_producer(manager, tok, engine, RLJob.model_validate(doc).spec.stages[1].swarm)
    producer.set_mode(Mode(EXPLORE, "swarm", [("wide", 4)], 1))  # the stage starts at version 10
    paid = {}
    for step in (2, 4, 6):
        engine.policy_version = 10 + step
        t = asyncio.run(producer._episode("swarm", rescore=True, task_set="wide", index=0,
                                          sampling=SamplingOptions(), limits=EPISODE))[0]
        parts = t.reward_parts
        assert parts["parl/finish"] == 1.0  # one subagent asked for, one done
        assert t.reward == pytest.approx(parts["parl/lambda_parallel"] * parts["parl/parallel"]
                                         + parts["parl/lambda_finish"] + parts["parl/perf"])
        paid[step] = (parts["parl/lambda_parallel"], parts["parl/lambda_finish"])
    assert [paid[s] for s in sorted(paid)] == [pytest.approx(w) for w in (
        (0.2, 0.4), (0.1, 0.2), (0.0, 0.0))]
    from kiln.services.rollout.swarm_run import SwarmRun
    until_the_end = RLJob.model_validate(job_doc(subagents="subagents", lambdaFinish=0.4,
                                                 annealStart=2)).spec.stages[1].swarm
    assert [SwarmRun(until_the_end, None, max_steps=10).parl(s).lambda_finish
            for s in (2, 6, 10)] == pytest.approx([0.4, 0.2, 0.0])


def test_parl_reward_and_annealing_by_hand():
    parl = Parl(lambda_parallel=0.4, lambda_finish=0.2, target=4)
    parts = parl.reward(r_perf=1.0, peak=2, assigned=4, finished=3)
    assert (parts["parl/parallel"], parts["parl/finish"]) == (0.5, 0.75)
    assert parts["parl/total"] == pytest.approx(0.4 * 0.5 + 0.2 * 0.75 + 1.0)
    assert parl.reward(0.0, peak=9, assigned=0, finished=0)["parl/parallel"] == 1.0
    assert parl.reward(0.0, peak=0, assigned=0, finished=0)["parl/total"] == 0.0
    # r_parallel paid by outcome: a wrong answer reached in parallel earns none of it, a right
    # one earns it in full, partial credit in part; r_finish is paid as always (so assignments
    # refused past the limit still cost); the parts still say what the episode did.
    gated = Parl(lambda_parallel=0.4, lambda_finish=0.2, target=4, paid="outcome")
    wrong = gated.reward(r_perf=0.0, peak=4, assigned=4, finished=4)
    assert (wrong["parl/parallel"], wrong["parl/outcome_scale"]) == (1.0, 0.0)
    assert wrong["parl/total"] == pytest.approx(0.2)
    assert gated.reward(0.0, peak=4, assigned=8, finished=0)["parl/total"] == 0.0
    assert gated.reward(1.0, peak=4, assigned=4, finished=4)["parl/total"] == pytest.approx(1.6)
    assert gated.reward(1.0, peak=4, assigned=6, finished=4)["parl/total"] == pytest.approx(
        0.4 + 0.2 * 4 / 6 + 1.0)
    assert gated.reward(0.5, peak=4, assigned=4, finished=2)["parl/total"] == pytest.approx(
        0.5 * 0.4 + 0.2 * 0.5 + 0.5)
    assert gated.reward(-1.0, peak=4, assigned=4, finished=0)["parl/total"] == -1.0
    assert gated.reward(2.0, peak=2, assigned=2, finished=2)["parl/total"] == pytest.approx(
        0.4 * 0.5 + 0.2 + 2.0)
    # r_parallel paid for collected subagents counts the peak of those alone.
    read = Parl(lambda_parallel=0.4, lambda_finish=0.2, target=4, paid="collected")
    assert read.reward(0.0, peak=4, assigned=5, finished=0, peak_collected=0)["parl/total"] == 0.0
    assert read.reward(1.0, peak=4, assigned=4, finished=4, peak_collected=2)["parl/parallel"] == 0.5
    assert parl.reward(1.0, peak=4, assigned=4, finished=4, peak_collected=2)["parl/parallel"] == 1.0
    with pytest.raises(ValueError, match="peak_collected"):
        read.reward(1.0, peak=4, assigned=4, finished=4)
    assert [annealed(0.4, s, 10, 30) for s in (0, 10, 20, 25, 30, 99)] == pytest.approx(
        [0.4, 0.4, 0.2, 0.1, 0.0, 0.0])
    # The critical-path budget tightens from its start to its end by annealStart, then holds.
    swarm = RLJob.model_validate(job_doc(subagents="subagents", maxCriticalSteps=8,
                                         maxCriticalStepsStart=14, annealStart=12)).spec.stages[1].swarm
    assert [swarm.budget(s) for s in (0, 3, 6, 9, 12, 30)] == [14, 13, 11, 10, 8, 8]
    assert RLJob.model_validate(job_doc(subagents="subagents")).spec.stages[1].swarm.budget(0) is None
    # The job chooses how the shaping terms are paid; rollout's weights follow it.
    from kiln.services.rollout.swarm_run import SwarmRun
    for paid in ("always", "outcome", "collected"):
        settings = RLJob.model_validate(
            job_doc(subagents="subagents", parallelReward=paid)).spec.stages[1].swarm
        assert SwarmRun(settings, subagents=None, max_steps=10).parl(0).paid == paid


@pytest.mark.parametrize("swarm, message", [
    ({"subagents": "swarm"}, "does not come before this one"),
    ({"subagents": "nowhere"}, "neither an earlier stage"),
    ({"subagents": "subagents", "parallelReward": "sometimes"}, "parallelReward"),
    ({"subagents": "subagents", "annealStart": 5, "annealEnd": 5}, "annealEnd (5) must come after"),
    ({"subagents": "subagents", "maxSubagents": 2, "parallelTarget": 3}, "parallelTarget (3) exceeds"),
    ({"subagents": "subagents", "maxCriticalStepsStart": 14, "annealStart": 8},
     "maxCriticalStepsStart (14) needs a maxCriticalSteps"),
    ({"subagents": "subagents", "maxCriticalSteps": 8, "maxCriticalStepsStart": 6, "annealStart": 8},
     "maxCriticalStepsStart (6) needs a maxCriticalSteps at most as large (got 8)"),
    ({"subagents": "subagents", "maxCriticalSteps": 8, "maxCriticalStepsStart": 14},
     "tightens the budget until annealStart, which is 0"),
    ({"subagents": "subagents", "shapingCredit": "turns"}, "shapingCredit"),
])
def test_bad_swarm_settings_are_named(swarm, message):
    with pytest.raises(ValidationError, match=re.escape(message)):
        RLJob.model_validate(job_doc(**swarm))
    assert RLJob.model_validate(job_doc(subagents="subagents")).spec.stages[1].swarm.target == 8
