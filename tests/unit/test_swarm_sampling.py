"""How agent swarms sample: the orchestrator's tool choices (constrained to what the tools'
schemas allow, the tool's name at its own temperature, recorded on the trajectory for the
trainer; `assign` withdrawn at the subagent limit; cooled over a stage's training episodes but
never an evaluation's) and the frozen subagents at their own temperature.

The episodes are real `wide` episodes (sub-tasks' shell calls in bubblewrap sandboxes, the tags
format, a trained tokenizer) played by scripted engines that record the tool-choice rule of
every request (`helpers/swarm.py`), so that each test sees what the engine was asked to sample
from, and at which temperature."""
from __future__ import annotations

import asyncio
import re

import pytest
from pydantic import ValidationError

from kiln.api.spec import RLJob
from kiln.services.rollout.engine import SamplingOptions
from kiln.services.rollout.formats import make_format

from helpers.swarm import (EPISODE, WIDTH, Recording, episode_manager, job_doc, orchestrator,
                           parallel, play, serial, subagent_policy, swarm_producer,
                           train_swarm_tokenizer)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return train_swarm_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture()
def manager(tmp_path):
    return episode_manager(tmp_path)


def test_the_orchestrators_tool_choices_are_sampled_and_recorded(manager, tok):
    # toolChoiceTemperature: each request names where a tool is chosen and among what; the
    # trajectory records which of its tokens were such choices, for the trainer.
    engine = Recording(tok, orchestrator(serial(manager)))
    sub_engine = Recording(tok, subagent_policy, 0.05)
    explore = SamplingOptions(temperature=1.0, tool_choice_temperature=6.0)
    traj, _ = play(manager, tok, serial(manager), engine=engine, sub_engine=sub_engine,
                   sampling=explore)
    ids = lambda text: tok.encode(text, add_special_tokens=False)
    call, assign, wait, close = ids("<call>"), ids("assign"), ids("wait"), ids("</call>")
    (rule,) = set(engine.rules)
    # The tools' names after `<call>`, at the tool-choice temperature.
    assert rule.allowed(call) == (tuple(sorted(assign[:1] + wait[:1])), 6.0)
    # Every call the schemas' enums allow is chosen token by token at the orchestrator's own
    # temperature: after `assign`, `next` or a place; after `wait`, `all` or a name; after a
    # whole value, the closing tag alone.
    valid = ([f"assign {k}" for k in ["next", *range(1, WIDTH + 1)]]
             + [f"wait {k}" for k in ["all", *(f"s{i}" for i in range(1, WIDTH + 1))]])
    calls = [ids(c) + close for c in valid]
    for c in calls:
        for n in range(1, len(c)):
            ids_, temp = rule.allowed(call + c[:n])
            assert c[n] in ids_ and temp == 1.0
            assert set(ids_) == {d[n] for d in calls if d[:n] == c[:n]}
    assert rule.allowed(call + ids("wait all")) == (tuple(close), 1.0)
    assert rule.allowed(call + ids("assign next") + close) is None  # the reply is over
    assert set(sub_engine.rules) == {None}  # the subagents sample as their own options say
    traj.check()
    choice = traj.tool_choice
    # A reply's first token calls, answers or thinks, and is never anything else; it is
    # sampled at the orchestrator's own temperature.
    act = tuple(sorted(ids("<call>") + ids("<answer>") + ids("<think>")))
    assert rule.allowed([]) == (act, 1.0)
    assert rule.allowed(ids("<answer>")) is None  # what an answer says is free
    # Serial: each call's every token was a choice, the tool's name at the tool-choice
    # temperature, the rest at the orchestrator's own. The answer's opening too.
    replies = [ids(r) for r in serial(manager)[:-1]]
    assert choice.temperatures == ([t for r in replies for t in [1.0, 6.0] + [1.0] * (len(r) - 2)]
                                   + [1.0])
    chosen = [traj.tokens[i] for i in choice.positions]
    assert chosen == [t for r in replies for t in r] + ids("<answer>")
    assert choice.sets()[:3] == [list(act), list(rule.allowed(call)[0]),
                                 list(rule.allowed(call + assign)[0])]
    # Greedy episodes (evaluation) explore nothing, but decode under the same constraints: the
    # argmax among the tools' names and among the arguments' values.
    greedy = Recording(tok, orchestrator(serial(manager)))
    traj, _ = play(manager, tok, serial(manager), engine=greedy,
                   sampling=SamplingOptions(temperature=0.0, tool_choice_temperature=6.0))
    assert {c[:2] for r in greedy.rules for c in r.choices} == {c[:2] for c in rule.choices}
    assert {c[2] for r in greedy.rules for c in r.choices} == {1.0}
    assert traj.tool_choice.temperatures == [1.0] * len(choice.temperatures)


def test_at_the_subagent_limit_assign_leaves_the_tool_choice(manager, tok):
    # withdrawAtLimit: once two subagents (the limit) are out, the replies choose their tool
    # among `wait` alone, and the trajectory records it so; without it, `assign` stays.
    ids = lambda text: tok.encode(text, add_special_tokens=False)
    call, assign, wait = ids("<call>"), ids("assign")[:1], ids("wait")[:1]
    script = ["<call>assign 1</call>", "<call>assign 2</call>", "<call>wait all</call>", "ANSWER"]
    explore = SamplingOptions(temperature=1.0, tool_choice_temperature=6.0)
    tools = {}
    for withdraw in (True, False):
        engine = Recording(tok, orchestrator(script))
        traj, _ = play(manager, tok, script, engine=engine, max_subagents=2, sampling=explore,
                       withdraw=withdraw)
        traj.check()
        tools[withdraw] = [set(rule.allowed(call)[0]) for rule in engine.rules]
        # The tool-name choices the trajectory records: one per call, of three.
        named = [s for s, t in zip(traj.tool_choice.sets(), traj.tool_choice.temperatures) if t == 6.0]
        assert [set(s) for s in named] == tools[withdraw][:3]
    both = set(assign + wait)
    # The wide task's `assign` names no subagent: after the wait, none can take a new task.
    assert tools[True] == [both, both, set(wait), set(wait)]
    assert tools[False] == [both] * 4
    # Evaluations are offered the same tools as training; the job needs tool choices for it.
    from kiln.services.rollout.swarm_run import SwarmRun
    doc = job_doc(subagents="subagents", withdrawAtLimit=True)
    doc["spec"]["rollout"] = {"toolCallFormat": "tags", "sampling": {"toolChoiceTemperature": 6.0}}
    settings = RLJob.model_validate(doc).spec.stages[1].swarm
    assert [SwarmRun(settings, None, 8).options(3, training, SamplingOptions())["withdraw"]
            for training in (True, False)] == [True, True]
    # The tools offered reach rollout from an environment behind the sandbox service too, and
    # an episode that offers none cannot choose one.
    from kiln.episode import StepResult
    from kiln.services.sandbox import wire
    for offered in (None, [], ["wait"]):
        assert wire.step_from_proto(wire.step_to_proto(StepResult(tools=offered))).tools == offered
    episode = manager.open("wide", 0)
    conv = make_format("tags", tok).conversation(episode)
    with pytest.raises(ValueError, match="offers none of its tools"):
        conv.tool_choice([])
    asyncio.run(manager.close(episode.episode_id))
    with pytest.raises(ValidationError, match=re.escape(
            "swarm.withdrawAtLimit withdraws tools from the replies' tool choice; "
            "rollout.sampling.toolChoiceTemperature is unset")):
        RLJob.model_validate(job_doc(subagents="subagents", withdrawAtLimit=True))


def test_training_episodes_cool_their_tool_choice_and_evaluations_do_not(manager, tok):
    # toolChoiceTemperatureEnd: the producer plays a swarm stage's training episodes at a
    # tool-choice temperature falling from the rollout's to the end one by annealStart; an
    # evaluation's sampled episodes stay at the rollout's.
    doc = job_doc(subagents="subagents", toolChoiceTemperatureEnd=2.0, annealStart=4)
    doc["spec"]["rollout"] = {"toolCallFormat": "tags",
                              "sampling": {"temperature": 1.0, "toolChoiceTemperature": 6.0}}
    settings = RLJob.model_validate(doc).spec.stages[1].swarm
    engine = Recording(tok, orchestrator(parallel(manager)))
    explore = SamplingOptions(temperature=1.0, tool_choice_temperature=6.0)
    producer = swarm_producer(manager, tok, engine, settings, sampling=explore)
    producer._stage_start["swarm"] = 10  # the stage began at policy version 10

    def tool_temperature(step: int, rescore: bool) -> float:
        engine.policy_version = 10 + step
        (traj,) = asyncio.run(producer._episode("swarm", rescore=rescore, task_set="wide",
                                                index=0, sampling=explore, limits=EPISODE))
        assert traj.reward_parts["parl/perf"] == 1.0
        return max(traj.tool_choice.temperatures)  # the others are the orchestrator's own, 1

    assert [tool_temperature(s, True) for s in (0, 2, 4, 7)] == pytest.approx([6.0, 4.0, 2.0, 2.0])
    assert tool_temperature(7, False) == 6.0
    assert [settings.tool_choice_temperature(s, 6.0) for s in (0, 1, 4)] == [6.0, 5.0, 2.0]
    # Unset, the rollout's holds; set without one to anneal, the job is refused.
    unset = RLJob.model_validate(job_doc(subagents="subagents")).spec.stages[1].swarm
    assert unset.tool_choice_temperature(3, 6.0) == 6.0
    with pytest.raises(ValidationError, match=re.escape(
            "swarm.toolChoiceTemperatureEnd anneals rollout.sampling.toolChoiceTemperature, "
            "which is unset")):
        RLJob.model_validate(job_doc(subagents="subagents", toolChoiceTemperatureEnd=2.0))


def test_subagents_sample_at_their_own_temperature(monkeypatch, tok):
    # The orchestrator explores hot; the frozen subagents it hands chains to may stay greedy.
    from kiln.services.rollout.main import swarm_runs
    monkeypatch.setenv("KILN_TEACHER_ADDR", "127.0.0.1:1")
    fmt = make_format("tags", tok)
    hot = SamplingOptions(temperature=3.0, max_tokens=16, tool_choice_temperature=6.0)

    async def subagent_sampling(**settings) -> SamplingOptions:
        job = RLJob.model_validate(job_doc(subagents="subagents", **settings))
        run = swarm_runs(job, fmt, hot)["swarm"]
        await run.subagents.engine.close()
        return run.subagents.sampling

    # ... and choose their tools as their checkpoint does (tool choices explore for the
    # orchestrator being trained).
    assert asyncio.run(subagent_sampling()) == SamplingOptions(temperature=3.0, max_tokens=16)
    assert asyncio.run(subagent_sampling(subagentTemperature=0)) == SamplingOptions(
        temperature=0.0, max_tokens=16)
    with pytest.raises(ValidationError, match="subagentTemperature"):
        RLJob.model_validate(job_doc(subagents="subagents", subagentTemperature=-1))
    with pytest.raises(ValidationError, match=r"swarm.subagentTemperature=3: vLLM samples at most at 2"):
        RLJob.model_validate(job_doc(subagents="subagents", subagentTemperature=3))
