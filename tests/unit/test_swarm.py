"""Agent swarms: the orchestrator's tools, subagents on a frozen engine, the critical path and
the PARL reward.

The environment is real (`wide`: its sub-tasks' shell calls run in bubblewrap sandboxes, through
the sandbox service's episode manager) and so are the tags format and a trained tokenizer; the
two policies are scripted (a function of the decoded context), so that each test knows which
calls were made and in which order."""
from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest
from pydantic import ValidationError
from transformers import AutoTokenizer

from kiln.api.spec import RLJob
from kiln.models.tiny import train_tokenizer
from kiln.services.rollout.agent import Limits
from kiln.services.rollout.engine import Generation, SamplingOptions
from kiln.services.rollout.formats import make_format
from kiln.services.rollout.swarm import SubagentNotFrozen, Subagents, run_swarm_episode
from kiln.services.sandbox.client import LocalEnvClient
from kiln.services.sandbox.environments.chain import SPECIAL_TOKENS as TAGS
from kiln.services.sandbox.environments.wide import WideEnvironment, WideLookupEnvironment
from kiln.services.sandbox.episodes import EpisodeManager
from kiln.swarm import Parl, annealed

WIDTH = 3


def job_doc(**swarm) -> dict:
    stage = {"name": "swarm", "type": "rl", "tasks": ["wide"]}
    if swarm:
        stage["swarm"] = swarm
    return {"apiVersion": "kiln.dev/v1alpha1", "kind": "RLJob", "metadata": {"name": "swarm"},
            "spec": {"model": {"path": "m"},
                     "tasks": [{"name": "wide", "env": "wide", "generate": {"count": 4, "numSteps": WIDTH}},
                               {"name": "parts", "env": "wide-lookup", "generate": {"count": 4}}],
                     "stages": [{"name": "subagents", "type": "sft", "tasks": ["parts"]}, stage]}}


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    job = RLJob.model_validate(job_doc())
    envs = [(WideEnvironment(), None), (WideLookupEnvironment(), None)]
    texts, words = [], []
    for (env, _), spec in zip(envs, job.spec.tasks):
        tasks = env.generate_tasks(spec.generate)
        texts += env.tokenizer_corpus(tasks)
        words += env.tokenizer_words(tasks)
    path = train_tokenizer(texts, tmp_path_factory.mktemp("tok"), vocab_size=400,
                           special_tokens=list(TAGS) + sorted(set(words)), split_digits=True)
    return AutoTokenizer.from_pretrained(str(path))


@pytest.fixture()
def manager(tmp_path):
    return EpisodeManager(RLJob.model_validate(job_doc()), base_dir=tmp_path, owner="swarm-test")


class Scripted:
    """An engine whose reply is `policy(context text)`; counts generations running at once."""

    fingerprint = "scripted"

    def __init__(self, tok, policy, delay: float = 0.0, version: int = 0) -> None:
        self.tok, self.policy, self.delay, self.policy_version = tok, policy, delay, version
        self.running = self.peak = self.calls = 0

    async def generate(self, prompt, sampling):
        self.running += 1
        self.peak = max(self.peak, self.running)
        self.calls += 1
        try:
            await asyncio.sleep(self.delay)
            reply = self.policy(self.tok.decode(prompt, skip_special_tokens=False))
        finally:
            self.running -= 1
        ids = self.tok.encode(reply, add_special_tokens=False)
        return Generation(ids, [-0.1] * len(ids), [self.policy_version] * len(ids), "stop")


def subagent_policy(text: str) -> str:
    """Follow the chain: cat the start, then each value read, then answer the last."""
    start, hops = map(int, re.search(r"end of (\d+), (\d+) hops", text).groups())
    seen = re.findall(r"<obs>(\d+)</obs>", text)
    if len(seen) < hops:
        return f"<call>bash cat notes/{seen[-1] if seen else start}</call>"
    return f"<answer>{seen[-1]}</answer>"


def orchestrator(script: list[str]):
    """Replies in order; `ANSWER` becomes the ends read from the waits, in s1, s2, ... order."""
    def policy(text: str) -> str:
        reply = script[len(re.findall(r"</call>", text))]
        if reply == "ANSWER":
            ends = dict(re.findall(r"(s\d+): (\d+)", text))
            return f"<answer>{' '.join(ends[k] for k in sorted(ends))}</answer>"
        return reply
    return policy


def starts(manager) -> list[int]:
    return manager.task("wide", 0).starts


EPISODE = Limits(max_turns=12, max_tokens_per_turn=16, max_total_tokens=512)
"""The orchestrator's limits in these tests."""


def play(manager, tok, script, *, parl=Parl(0.5, 0.5, WIDTH), sub_engine=None, engine=None,
         max_subagents=8, delay=0.05, sampling=SamplingOptions(), budget=None,
         end_on_refusal=False, credit="episode", withdraw=False):
    fmt = make_format("tags", tok)
    sub_engine = sub_engine or Scripted(tok, subagent_policy, delay)
    subagents = Subagents(sub_engine, fmt, SamplingOptions(), Limits(max_turns=4, max_tokens_per_turn=16),
                          max_per_episode=max_subagents)
    engine = engine or Scripted(tok, orchestrator(script))
    trajs = asyncio.run(run_swarm_episode(
        engine, LocalEnvClient(manager), fmt, subagents, parl, task_set="wide", index=0,
        budget=budget, end_on_refusal=end_on_refusal, credit=credit, withdraw=withdraw,
        sampling=sampling, limits=EPISODE))
    return trajs[0], sub_engine


def swarm_producer(manager, tok, engine, settings, *, sampling=SamplingOptions(),
                   max_subagents=8):
    """The rollout producer of a job whose stage `swarm` has `settings`, on scripted engines."""
    from kiln.services.rollout.producer import Producer
    from kiln.services.rollout.swarm import SwarmRun
    fmt = make_format("tags", tok)
    subagents = Subagents(Scripted(tok, subagent_policy), fmt, SamplingOptions(),
                          Limits(max_turns=4, max_tokens_per_turn=16),
                          max_per_episode=max_subagents)
    return Producer(engine, LocalEnvClient(manager), fmt, None, sampling=sampling, limits=EPISODE,
                    max_concurrent=1, swarms={"swarm": SwarmRun(settings, subagents, max_steps=8)})


def serial(manager) -> list[str]:
    return [r for k in range(1, len(starts(manager)) + 1)
            for r in (f"<call>assign {k}</call>", "<call>wait all</call>")
            ] + ["ANSWER"]


def parallel(manager) -> list[str]:
    # `next`: the k-th assignment takes the k-th chain (the example's demonstrations' form).
    return (["<call>assign next</call>" for _ in starts(manager)]
            + ["<call>wait all</call>", "ANSWER"])


def test_assigning_before_waiting_runs_subagents_at_once_and_shortens_the_critical_path(manager, tok):
    one, sub_one = play(manager, tok, serial(manager))
    many, sub_many = play(manager, tok, parallel(manager))
    for t in (one, many):
        assert t.reward_parts["parl/perf"] == 1.0, t.verifier_output
        assert t.reward_parts["parl/finish"] == 1.0
        assert t.reward_parts["swarm/subagents"] == WIDTH
        # 3 subagents x (2 reads + 1 answer) calls, plus the orchestrator's own.
        assert t.reward_parts["swarm/total_steps"] == 3 * WIDTH + (2 * WIDTH + 1 if t is one else WIDTH + 2)
    # Serial: assign (1), the subagent's 3 calls (2..4) before the wait's result is seen, for
    # each start in turn, then the answer: 4 * 3 + 1. Parallel: the last assign at depth 3, its
    # subagent done at 6, the answer at 7.
    assert one.reward_parts["swarm/critical_path_steps"] == 4 * WIDTH + 1
    assert many.reward_parts["swarm/critical_path_steps"] == WIDTH + 4
    assert (sub_one.peak, sub_many.peak) == (1, WIDTH)
    assert (one.reward_parts["swarm/peak_parallel"], many.reward_parts["swarm/peak_parallel"]) == (1, WIDTH)
    assert one.reward == pytest.approx(0.5 / WIDTH + 0.5 + 1.0)
    assert many.reward == pytest.approx(0.5 + 0.5 + 1.0)


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


class Recording(Scripted):
    """A scripted engine that keeps the tool-choice rule of every request."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.rules = []

    async def generate(self, prompt, sampling):
        self.rules.append(sampling.tool_choice)
        return await super().generate(prompt, sampling)


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
    from kiln.services.rollout.swarm import SwarmRun
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


def test_only_the_orchestrators_replies_are_trained_on(manager, tok):
    t, _ = play(manager, tok, parallel(manager))
    trained = tok.decode([x for x, m in zip(t.tokens, t.loss_mask) if m], skip_special_tokens=False)
    ends = manager.task("wide", 0).ends
    assert trained == "".join(parallel(manager)[:-1]) + f"<answer>{' '.join(map(str, ends))}</answer>"
    context = tok.decode([x for x, m in zip(t.tokens, t.loss_mask) if not m], skip_special_tokens=False)
    # The subagents' answers reached the orchestrator as one observation; their reads did not.
    assert "<obs>" + "\n".join(f"s{i}: {e}" for i, e in enumerate(ends, 1)) + "</obs>" in context
    assert "cat notes" not in tok.decode(t.tokens, skip_special_tokens=False)


def test_limits_and_a_subagents_failure_become_observations(manager, tok):
    lost = starts(manager)[1]

    def failing(text: str) -> str:  # the second chain's subagent loses its engine
        if f"end of {lost}," in text:
            raise RuntimeError("engine lost")
        return subagent_policy(text)

    script = ["<call>wait all</call>", "<call>assign 1</call>", "<call>assign 5</call>",
              "<call>assign 2</call>", "<call>assign 3</call>", "<call>wait s9</call>",
              "<call>wait all</call>", "ANSWER"]
    t, _ = play(manager, tok, script, max_subagents=2, sub_engine=Scripted(tok, failing, 0.05))
    context = tok.decode(t.tokens, skip_special_tokens=False)
    obs = re.findall(r"<obs>(.*?)</obs>", context, re.S)
    assert obs[0] == "error: no subagent is working"
    # A place the task does not have is refused by the tool's schema; nothing is assigned.
    assert obs[1:4] == ["s1", "error: assign: arguments.task must be one of ['next', '1', '2', '3']", "s2"]
    assert obs[4] == "error: this episode may create at most 2 subagents"
    assert obs[5] == "error: wait: arguments.subagents must be one of ['all', 's1', 's2', 's3']"
    assert obs[6].splitlines() == [f"s1: {manager.task('wide', 0).ends[0]}",
                                   "s2: error: RuntimeError: engine lost"]
    # Of three assignments asked for (the schema's refusal never reached the tool), one was
    # refused past the limit and one failed: r_finish 1/3.
    assert t.reward_parts["swarm/assigned"] == 2 and t.reward_parts["swarm/refused"] == 1
    assert t.reward_parts["parl/finish"] == pytest.approx(1 / 3)
    assert t.reward_parts["parl/perf"] == 0.0  # two ends of three


def test_a_training_episode_held_to_its_limits_ends_at_the_first_refused_assignment(manager, tok):
    # endOnRefusal: the assignment past maxSubagents ends the episode unanswered, where it
    # would otherwise be an observation and the episode would go on.
    script = ["<call>assign 1</call>", "<call>assign 2</call>", "<call>assign 3</call>",
              "<call>wait all</call>", "ANSWER"]
    t, _ = play(manager, tok, script, max_subagents=2, end_on_refusal=True)
    refusal = "error: this episode may create at most 2 subagents"

    def context(t) -> str:
        return tok.decode(t.tokens, skip_special_tokens=False)
    assert re.findall(r"<obs>(.*?)</obs>", context(t)) == ["s1", "s2"]
    assert (t.flags, t.verifier_output) == (["refused"], refusal)
    parts = t.reward_parts
    assert (parts["answered"], parts["parl/perf"]) == (0, 0)
    assert (parts["swarm/refused"], parts["swarm/assigned"]) == (1, 2)
    assert parts["swarm/peak_parallel_collected"] == 0  # nothing was waited for
    t, _ = play(manager, tok, script, max_subagents=2)
    assert t.flags == [] and t.reward_parts["swarm/refused"] == 1
    assert refusal in context(t) and t.verifier_output.startswith("answered")
    # The producer holds training episodes to it, never an evaluation's.
    doc = job_doc(subagents="subagents", endOnRefusal=True)
    producer = swarm_producer(manager, tok, Scripted(tok, orchestrator(script)),
                              RLJob.model_validate(doc).spec.stages[1].swarm, max_subagents=2)
    flags = [asyncio.run(producer._episode("swarm", rescore=rescore, task_set="wide", index=0,
                                           sampling=SamplingOptions(), limits=EPISODE))[0].flags
             for rescore in (True, False)]
    assert flags == [["refused"], []]


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


def test_wait_all_shows_every_answer_so_far_and_a_named_wait_only_those(manager, tok):
    ends = manager.task("wide", 0).ends
    t, _ = play(manager, tok, serial(manager))
    obs = re.findall(r"<obs>(.*?)</obs>", tok.decode(t.tokens, skip_special_tokens=False), re.S)
    waits = obs[1::2]  # assign, wait, assign, wait, ...
    # Each `wait all` lists s1..sk, not only the subagent that just finished.
    assert waits == ["\n".join(f"s{j}: {e}" for j, e in enumerate(ends[:k], 1))
                     for k in range(1, WIDTH + 1)]

    script = ["<call>assign 1</call>", "<call>assign 2</call>", "<call>wait s2</call>",
              "<call>wait s1</call>", "ANSWER"]
    t, _ = play(manager, tok, script)
    obs = re.findall(r"<obs>(.*?)</obs>", tok.decode(t.tokens, skip_special_tokens=False), re.S)
    assert obs[2:] == [f"s2: {ends[1]}", f"s1: {ends[0]}"]


def test_a_demonstration_sees_what_rollout_returns_a_second_wait_included(manager, tok):
    import random
    env, task = WideEnvironment(), manager.task("wide", 0)
    seed = next(i for i in range(100) if len(env.demonstrate(task, random.Random(i))) > 2 * WIDTH + 1)
    turns = env.demonstrate(task, random.Random(seed))
    script = [f"<call>{c.name} {next(iter(c.arguments.values()))}</call>"
              for t in turns[:-1] for c in t.tool_calls] + [f"<answer>{turns[-1].content}</answer>"]
    t, _ = play(manager, tok, script)
    obs = re.findall(r"<obs>(.*?)</obs>", tok.decode(t.tokens, skip_special_tokens=False), re.S)
    assert obs == [o for turn in turns[:-1] for o in turn.outputs]
    assert t.reward_parts["parl/perf"] == 1.0
    # Waiting again with nothing running shows the board; a named wait on a collected
    # subagent, or any wait before an assignment, is an error.
    t, _ = play(manager, tok, ["<call>assign next</call>", "<call>wait all</call>",
                               "<call>wait all</call>", "<call>wait s1</call>", "ANSWER"])
    obs = re.findall(r"<obs>(.*?)</obs>", tok.decode(t.tokens, skip_special_tokens=False), re.S)
    assert obs[1] == obs[2] == f"s1: {task.ends[0]}"
    assert obs[3] == "error: s1 has no task to wait for"


def test_subagents_stay_on_their_pinned_version(manager, tok):
    # The orchestrator's weights change during the episode; the subagents' never do.
    script = parallel(manager)
    engine = Scripted(tok, orchestrator(script))
    policy = engine.policy

    def moving(text: str) -> str:
        engine.policy_version += 1
        return policy(text)
    engine.policy = moving
    t, sub = play(manager, tok, script, engine=engine)
    assert t.newest_version > t.oldest_version and sub.policy_version == 0
    assert t.reward_parts["parl/perf"] == 1.0

    # A subagents' engine that got new weights is a broken deployment: the episode fails.
    drifting = Scripted(tok, subagent_policy)
    sub_policy = drifting.policy

    def drift(text: str) -> str:
        drifting.policy_version = 3
        return sub_policy(text)
    drifting.policy = drift
    with pytest.raises(SubagentNotFrozen, match="pinned to version 0"):
        play(manager, tok, parallel(manager), sub_engine=drifting)


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
    from kiln.services.rollout.swarm import SwarmRun
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


def test_wide_demonstrations_solve_their_tasks_and_splits_never_meet():
    import random
    env = WideEnvironment()
    spec = RLJob.model_validate(job_doc()).spec.tasks[0].generate
    train = env.generate_tasks(spec)
    held = env.generate_tasks(spec.model_copy(update={"split": "heldout"}))
    assert not {tuple(t.starts) for t in train} & {tuple(t.starts) for t in held}
    rechecked = 0
    for i, task in enumerate(train):
        turns = env.demonstrate(task, random.Random(i))
        assert env.grade_demonstration(task, turns).reward == 1.0
        # Serial: each `assign next` is followed by a wait on it before the next one; now and
        # then the same board is waited on once more.
        calls = [(c.name, *c.arguments.values()) for t in turns[:-1] for c in t.tool_calls]
        assert calls[0] == ("assign", "next") and calls.count(("assign", "next")) == WIDTH
        assert set(calls) == {("assign", "next"), ("wait", "all")}
        assert (("assign", "next"),) * 2 not in zip(calls, calls[1:])
        assert calls[-1] == ("wait", "all")
        boards = [t.outputs[0] for t in turns[:-1] if t.tool_calls[0].name == "wait"]
        assert len(boards) == len(calls) - WIDTH
        assert [len(b.splitlines()) for b in boards] == sorted(len(b.splitlines()) for b in boards)
        rechecked += len(boards) > WIDTH
        # The answer copies the last results board; bare ends in order are right too.
        assert turns[-1].content == turns[-2].outputs[0]
        ends = [str(e) for e in task.ends]
        assert env._grade(task, " ".join(ends)).reward == 1.0
        assert env._grade(task, " ".join(reversed(ends))).reward == 0.0
        partial = env._grade(task, "\n".join(f"s{i}: {e}" for i, e in enumerate(ends[:-1], 1)))
        assert partial.reward == 0.0 and partial.parts["ends_correct"] == pytest.approx(2 / 3)
        sub = env.subtask(task, "worker", "", "2")
        assert (sub.starts, sub.ends) == ([task.starts[1]], [task.ends[1]])
        assert WideLookupEnvironment().grade_demonstration(sub, env.demonstrate(sub, random.Random(0))).reward == 1.0
        for bad in ("x", "0", str(WIDTH + 1), str(task.starts[0])):
            with pytest.raises(ValueError, match="not one of this task's chains"):
                env.subtask(task, "worker", "", bad)
        # `next`: the chain after the ones handed out so far, whatever the places named.
        assert [env.subtask(task, "worker", "", "next", index=i).starts for i in range(WIDTH)] == [
            [s] for s in task.starts]
        with pytest.raises(ValueError, match="every chain of this task has been handed out"):
            env.subtask(task, "worker", "", "next", index=WIDTH)
    assert 0 < rechecked < len(train)
