"""Agent swarms' episodes: the orchestrator's tools and what it sees of its subagents, subagents
on a frozen engine, the critical path, limits and failures, what is trained on, and the `wide`
environment's tasks and demonstrations.

The environment is real (`wide`: its sub-tasks' shell calls run in bubblewrap sandboxes, through
the sandbox service's episode manager) and so are the tags format and a trained tokenizer; the
two policies are scripted (a function of the decoded context; `helpers/swarm.py`), so that each
test knows which calls were made and in which order. The PARL reward's terms are
`test_swarm_rewards.py`'s, how replies are sampled `test_swarm_sampling.py`'s."""
from __future__ import annotations

import asyncio
import re

import pytest

from kiln.api.spec import RLJob
from kiln.services.rollout.engine import SamplingOptions
from kiln.services.rollout.swarm import SubagentNotFrozen
from kiln.services.sandbox.environments.wide import WideEnvironment, WideLookupEnvironment

from helpers.swarm import (EPISODE, WIDTH, Scripted, episode_manager, job_doc, orchestrator,
                           parallel, play, serial, starts, subagent_policy, swarm_producer,
                           train_swarm_tokenizer)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return train_swarm_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture()
def manager(tmp_path):
    return episode_manager(tmp_path)


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


def test_the_peak_counts_subagents_until_collected_not_until_they_finish(manager, tok):
    """r_parallel's peak is in the episode's order of calls: with an orchestrator slow enough
    that each subagent has finished (in wall-clock time) before the next assignment, assigning
    every sub-task before one wait still counts them all side by side; serial use counts 1."""
    slow = Scripted(tok, orchestrator(parallel(manager)), 0.4)
    many, _ = play(manager, tok, parallel(manager), engine=slow, delay=0.0)
    assert many.reward_parts["swarm/peak_parallel"] == WIDTH
    assert many.reward_parts["parl/parallel"] == 1.0
    one, _ = play(manager, tok, serial(manager), delay=0.0)
    assert one.reward_parts["swarm/peak_parallel"] == 1


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
        assert WideLookupEnvironment().grade_demonstration(
            sub, env.demonstrate(sub, random.Random(0))).reward == 1.0
        for bad in ("x", "0", str(WIDTH + 1), str(task.starts[0])):
            with pytest.raises(ValueError, match="not one of this task's chains"):
                env.subtask(task, "worker", "", bad)
        # `next`: the chain after the ones handed out so far, whatever the places named.
        assert [env.subtask(task, "worker", "", "next", index=i).starts for i in range(WIDTH)] == [
            [s] for s in task.starts]
        with pytest.raises(ValueError, match="every chain of this task has been handed out"):
            env.subtask(task, "worker", "", "next", index=WIDTH)
    assert 0 < rechecked < len(train)
