"""Every example task set played as episodes through a real sandbox service process, over gRPC:
a scripted policy that solves each task gets reward 1, a null policy (give up at once) gets 0,
and an episode that edits a hidden SWE test is scored 0 and flagged. The tools run in
bubblewrap sandboxes; the search tools answer from the service's BM25 index.

The policies here are scripts, not models: what is under test is the environments' episodes
(prompts, tools, grading) as rollout reaches them. The model-driven loop over the same service
is tested in test_kiln_run.py and test_environments_rl.py.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import yaml

from kiln.episode import Action
from kiln.services.sandbox.client import GrpcEnvClient

from helpers.episodes import REPO, SCRIPTED, TASKS, answer, call

PLUGINS = REPO / "deploy" / "examples" / "plugins"

pytestmark = pytest.mark.slow


SETS = {"terminal": "terminal.jsonl", "swe": "swe.jsonl", "search": "search.jsonl",
        "code": "code.jsonl", "echo": "echo.jsonl"}


def _job(tmp: Path) -> Path:
    tasks = [{"name": name, "env": name if name != "echo" else {"plugin": "echo_env:EchoFileEnv"},
              "path": str(TASKS / file)} for name, file in SETS.items()]
    tasks.append({"name": "lookup", "env": "lookup", "generate": {"count": 8, "seed": 1, "numSteps": 3}})
    job = {"apiVersion": "kiln.dev/v1alpha1", "kind": "RLJob", "metadata": {"name": "episodes"},
           "spec": {"model": {"path": str(tmp / "no-model")}, "tasks": tasks,
                    "stages": [{"name": "rl", "type": "rl", "tasks": [*SETS, "lookup"], "batchSize": 8,
                                "microBatchSize": 8}],
                    "rollout": {"maxTurns": 6}, "sandbox": {"timeoutSeconds": 20}}}
    path = tmp / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


@pytest.fixture(scope="module")
def env_address(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("episodes")
    ports = tmp / "ports.json"
    log = (tmp / "sandbox.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "kiln.services.sandbox.main", "--job", str(_job(tmp)),
         "--address", "127.0.0.1:0", "--metrics-port", "0", "--port-file", str(ports),
         "--owner", f"t-episodes-{os.getpid()}"],
        stdout=log, stderr=subprocess.STDOUT, cwd=tmp,
        env={**os.environ, "PYTHONPATH": str(PLUGINS)})
    deadline = time.monotonic() + 60
    while not ports.exists():
        assert proc.poll() is None and time.monotonic() < deadline, (tmp / "sandbox.log").read_text()
        time.sleep(0.1)
    address = f"127.0.0.1:{json.loads(ports.read_text())['port']}"
    with grpc.insecure_channel(address) as ch:
        grpc.channel_ready_future(ch).result(timeout=30)
    yield address
    proc.send_signal(signal.SIGTERM)
    proc.wait(30)


async def _play(address: str, task_set: str, index: int, actions: list[Action]):
    async with grpc.aio.insecure_channel(address) as ch:
        env = GrpcEnvClient(ch, owner="test")
        for _ in range(20):  # the sandbox service may still be building its task sets
            try:
                sets = await env.task_sets()
                break
            except grpc.aio.AioRpcError:
                await asyncio.sleep(0.5)
        ep = await env.open(task_set, index, 0)
        results = []
        try:
            for action in actions:
                r = await env.step(ep.episode_id, action)
                results.append(r)
                if r.done:
                    break
        finally:
            await env.close(ep.episode_id)
        return sets, ep, results


def _tasks(task_set: str) -> list[str]:
    return [json.loads(line)["id"] for line in (TASKS / SETS[task_set]).read_text().splitlines()
            if line.strip()]


@pytest.mark.parametrize("task_set", list(SETS))
def test_scripted_policy_solves_and_null_policy_fails_every_task(env_address, task_set):
    for index, task_id in enumerate(_tasks(task_set)):
        sets, ep, results = asyncio.run(_play(env_address, task_set, index, SCRIPTED[task_id]))
        assert sets[task_set][1] == len(_tasks(task_set))
        assert ep.task_id == task_id and ep.messages[-1].role == "user" and ep.tools
        final = results[-1]
        assert final.done and final.reward == 1.0, (task_id, final)
        for r in results[:-1]:
            assert not r.done and len(r.outputs) == 1 and r.outputs[0].content
        null = [call("submit")] if any(t.name == "submit" for t in ep.tools) else [answer("no idea")]
        _, _, results = asyncio.run(_play(env_address, task_set, index, null))
        assert results[-1].done and results[-1].reward == 0.0, (task_id, results[-1])


def test_tool_outputs_reach_the_agent(env_address):
    _, ep, results = asyncio.run(_play(env_address, "search", 0, SCRIPTED["observatory-river"]))
    assert [t.name for t in ep.tools] == ["search", "open"]
    assert "[marrow.txt]" in results[0].outputs[0].content  # a BM25 hit, over gRPC
    assert "Marrow" in results[1].outputs[0].content
    _, _, results = asyncio.run(_play(env_address, "terminal", 0, [
        call("bash", command="cat data/words.txt; echo oops >&2; exit 3")]))
    out = results[0].outputs[0].content
    assert out.startswith("exit code 3") and "alpha beta gamma" in out and "oops" in out
    _, _, results = asyncio.run(_play(env_address, "terminal", 0, [call("dance")]))
    assert "unknown tool 'dance'" in results[0].outputs[0].content


@pytest.mark.parametrize("edit", [
    call("str_replace", path="tests/test_ops.py", old="assertIsNone(divide(1, 0))",
         new="assertTrue(True)"),
    call("bash", command="rm tests/test_ops.py"),
    call("create", path="tests/conftest.py", content="import sys\n"),
], ids=["edit-test", "delete-test", "add-conftest"])
def test_editing_hidden_tests_scores_zero(env_address, edit):
    actions = [SCRIPTED["calc-divide-by-zero"][1], edit, call("submit")]
    _, _, results = asyncio.run(_play(env_address, "swe", 0, actions))
    final = results[-1]
    assert final.done and final.reward == 0.0 and "tests_modified" in final.flags, final


def test_lookup_tasks_score_the_file_the_shell_wrote(env_address):
    """The terminal quickstart's tasks: the scripted solver, played for real in the sandbox,
    scores what its demonstration's grade says (1 unless its blind spot dropped a 0); a
    written wrong number and no answer score 0."""
    import random
    from types import SimpleNamespace

    from kiln.services.sandbox.environments.lookup import LookupEnvironment

    env = LookupEnvironment()
    tasks = env.generate_tasks(SimpleNamespace(count=8, seed=1, split="train", num_steps=3))
    seen = set()
    for index, task in enumerate(tasks):
        turns = env.demonstrate(task, random.Random(index))
        expected = env.grade_demonstration(task, turns).reward
        seen.add(expected)
        actions = [Action(list(t.tool_calls), t.content) for t in turns]
        _, ep, results = asyncio.run(_play(env_address, "lookup", index, actions))
        assert ep.task_id == task.id and [t.name for t in ep.tools] == ["bash"]
        for r, turn in zip(results, turns):
            if not r.done:  # what the sandbox printed is what the solver knew it would
                assert [o.content for o in r.outputs] == turn.outputs
        assert results[-1].done and results[-1].reward == expected, (task.id, results[-1])
        wrong = [call("bash", command=f"echo {task.answer % 89 + 10} > answer.txt"), answer("Done.")]
        _, _, results = asyncio.run(_play(env_address, "lookup", index, wrong))
        assert results[-1].reward == 0.0
    assert 1.0 in seen
