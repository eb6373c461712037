"""The OpenAI chat-completions endpoint: the official `openai` client as an agent scaffold.

In-process tests run the server with the plain-transformers engine; the slow test runs
`kiln serve` (vLLM) as its own process, then trains an RL step on what it recorded. The probes
of its door (keys, episode ownership, rewards, limits) are in test_openai_endpoint_probes.py.
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

import httpx
import pytest
import torch
from openai import AsyncOpenAI, BadRequestError, OpenAI
from transformers import AutoModelForCausalLM, AutoTokenizer

from kiln.services.rollout.engine import EngineSettings
from kiln.services.rollout.formats import make_format
from kiln.services.rollout.openai_auth import ApiKeys
from kiln.services.rollout.openai_episodes import ExternalEpisodes
from kiln.services.rollout.openai_server import OpenAIServer
from kiln.services.rollout.torch_engine import TorchEngine
from kiln.trajectory import Trajectory
from helpers.toolcall_model import PROMPT, SCRIPT, TOOLS, shared_toolcall_model

KEY = "test-key-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {KEY}"}

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return shared_toolcall_model(tmp_path_factory)


async def _serve(model_dir: Path, scenario):
    """Run `scenario(client, base_url)` against an in-process server; (result, trajectories)."""
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    engine = await TorchEngine.start(EngineSettings(model=str(model_dir), dtype="float32"))
    stored: list[tuple[Trajectory, int]] = []

    async def sink(trajs, size):
        stored.extend((t, size) for t in trajs)

    episodes = ExternalEpisodes(engine, make_format("hermes", tok), sink, max_tokens_per_turn=40,
                                max_total_tokens=400)
    server = OpenAIServer(episodes, model_name="tiny", tokenizer=tok, keys=ApiKeys({KEY: "test"}))
    port = await server.start()
    base = f"http://127.0.0.1:{port}/v1"
    try:
        async with AsyncOpenAI(base_url=base, api_key=KEY, max_retries=0) as client:
            result = await scenario(client, base)
    finally:
        await server.stop()
        await engine.close()
    return result, stored


async def play(client, episode: str, *, history_edit=None, **kw) -> list:
    """The scaffold: call, run the tool calls from SCRIPT's outputs, repeat for three turns."""
    messages: list[dict] = [{"role": "user", "content": PROMPT}]
    responses = []
    for turn in range(3):
        resp = await client.chat.completions.create(
            model="tiny", messages=messages, tools=TOOLS, temperature=1.0,
            extra_headers={"X-Kiln-Episode": episode}, **kw)
        responses.append(resp)
        msg = resp.choices[0].message
        messages.append(msg.model_dump(exclude_none=True, exclude={"refusal", "annotations", "audio"}))
        for call in msg.tool_calls or []:
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": SCRIPT[min(turn, len(SCRIPT) - 1)][1]})
        if history_edit and turn == 0:
            messages = history_edit(messages)
        if not msg.tool_calls:
            break
    return responses


async def open_episode(base: str) -> str:
    async with httpx.AsyncClient() as http:
        r = await http.post(f"{base}/kiln/episodes", headers=AUTH)
    assert r.status_code == 201, r.text
    return r.json()["episode_id"]


async def reward(base: str, episode: str, value: float, **extra) -> httpx.Response:
    async with httpx.AsyncClient() as http:
        return await http.post(f"{base}/kiln/episodes/{episode}/reward",
                               json={"reward": value, **extra}, headers=AUTH)


def test_a_three_turn_tool_episode_is_one_exact_trajectory(model_dir: Path) -> None:
    async def scenario(client, base):
        ep = await open_episode(base)
        responses = await play(client, ep, logprobs=True)
        r = await reward(base, ep, 1.0, task_id="files", group_id="g", group_size=1)
        return responses, r

    (responses, r), stored = asyncio.run(_serve(model_dir, scenario))
    assert r.status_code == 200, r.text
    calls = [c.function for resp in responses for c in resp.choices[0].message.tool_calls or []]
    assert [json.loads(c.arguments) for c in calls] == [{"command": "ls"}, {"command": "cat a.txt"}]
    assert len(responses) == 3 and responses[2].choices[0].finish_reason == "stop"
    [(traj, size)] = stored
    assert size == 1 and traj.reward == 1.0 and traj.task_id == "files" and traj.env == "openai"
    sampled = [t for t, m in zip(traj.tokens, traj.loss_mask) if m]
    logps = [lp for lp, m in zip(traj.logp_infer, traj.loss_mask) if m]
    kiln = [resp.model_extra["kiln"] for resp in responses]
    assert sampled == [t for k in kiln for t in k["token_ids"]]
    assert logps == [lp for k in kiln for lp in k["logprobs"]]
    standard = [c.logprob for resp in responses for c in resp.choices[0].logprobs.content]
    assert standard == logps
    assert set(traj.versions_per_token()) == {-1, 0}
    traj.check()
    # The context between replies is what the template writes: decoding the stitched tokens
    # gives the template's rendering of the whole conversation (up to the newline it writes
    # after the last reply's end token, which the model never saw).
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    replies = [tok.decode(k["token_ids"][:-1], skip_special_tokens=False) for k in kiln]
    messages = [{"role": "user", "content": PROMPT}]
    for i, text in enumerate(replies):
        messages.append({"role": "assistant", "content": text})
        if i < len(SCRIPT):
            messages.append({"role": "tool", "content": SCRIPT[i][1]})
    rendered = tok.apply_chat_template(messages, tools=TOOLS, tokenize=False)
    assert tok.decode(traj.tokens, skip_special_tokens=False) == rendered.removesuffix("\n")
    # The recorded log-probs are the model's: rescored with transformers.
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    with torch.no_grad():
        ids = torch.tensor([traj.tokens])
        ref = torch.log_softmax(model(ids).logits[0, :-1], -1).gather(-1, ids[0, 1:, None])[:, 0]
    got = torch.tensor(traj.logp_infer[1:])
    mask = torch.tensor(traj.loss_mask[1:]).bool()
    assert (got[mask] - ref[mask]).abs().max().item() < 1e-4


def test_a_rewritten_history_starts_a_new_segment(model_dir: Path) -> None:
    def drop_first_turn(messages):
        # A scaffold that condenses its context: the first reply is summarised by the user.
        return [{"role": "user", "content": PROMPT}, {"role": "user", "content": "a.txt"}]

    async def scenario(client, base):
        ep = await open_episode(base)
        await play(client, ep, history_edit=drop_first_turn)
        return await reward(base, ep, 0.0)

    r, stored = asyncio.run(_serve(model_dir, scenario))
    assert r.status_code == 200 and len(r.json()["trajectories"]) == 2
    flags = [t.flags for t, _ in stored]
    assert flags == [["external", "segment:0"], ["external", "segment:1"]]
    assert stored[0][0].group_id == stored[1][0].group_id
    assert all(t.reward == 0.0 and any(t.loss_mask) for t, _ in stored)


def test_streaming_gives_the_same_message(model_dir: Path) -> None:
    async def scenario(client, base):
        ep = await open_episode(base)
        stream = await client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": PROMPT}], tools=TOOLS,
            stream=True, extra_headers={"X-Kiln-Episode": ep})
        chunks = [c async for c in stream]
        return chunks, await reward(base, ep, 1.0)

    (chunks, r), stored = asyncio.run(_serve(model_dir, scenario))
    calls = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    assert [json.loads(tc.function.arguments) for tc in calls] == [{"command": "ls"}]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert r.status_code == 200 and len(stored) == 1


def test_bad_requests_name_the_field(model_dir: Path) -> None:
    async def scenario(client, base):
        problems = []
        e = await open_episode(base)
        for kw in ({"n": 2}, {"stop": ["\n"]}, {"tool_choice": "required"}):
            try:
                await client.chat.completions.create(
                    model="tiny", messages=[{"role": "user", "content": PROMPT}],
                    extra_headers={"X-Kiln-Episode": e}, **kw)
            except BadRequestError as exc:
                problems.append(exc.body["message"])
        return problems, await reward(base, "never-started", 1.0), await reward(base, e, "high")

    (problems, unknown, bad), _ = asyncio.run(_serve(model_dir, scenario))
    assert [p.split(":")[0] for p in problems] == ["n", "stop", "tool_choice"]
    assert unknown.status_code == 404 and "never-started" in unknown.json()["error"]["message"]
    assert bad.status_code == 400 and bad.json()["error"]["message"].startswith("reward:")


@pytest.mark.slow
def test_kiln_serve_episodes_train_in_an_rl_step(model_dir: Path, tmp_path: Path) -> None:
    """`kiln serve` (vLLM, its own process): two 3-turn episodes from the openai client, their
    trajectories exact, then one RL step on them."""
    ready, out = tmp_path / "ready.json", tmp_path / "trajectories.jsonl"
    (tmp_path / "keys").write_text(KEY + "\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT.parent) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "kiln.cli.main", "serve", str(model_dir), "--openai-port", "0",
         "--ready-file", str(ready), "--trajectories", str(out), "--max-tokens-per-turn", "40",
         "--api-key-file", str(tmp_path / "keys")],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 240
        while not ready.exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.poll() is not None else "timeout"
            time.sleep(0.5)
        base = f"http://127.0.0.1:{json.loads(ready.read_text())['port']}/v1"
        client = OpenAI(base_url=base, api_key=KEY, max_retries=0)
        kiln_calls = {}
        ids = {}
        for ep in ("a", "b"):
            ids[ep] = httpx.post(f"{base}/kiln/episodes", headers=AUTH).json()["episode_id"]
            messages: list[dict] = [{"role": "user", "content": PROMPT}]
            kiln_calls[ep] = []
            for turn in range(3):
                resp = client.chat.completions.create(model="m", messages=messages, tools=TOOLS,
                                                      extra_headers={"X-Kiln-Episode": ids[ep]})
                kiln_calls[ep].append(resp.model_extra["kiln"])
                msg = resp.choices[0].message
                messages.append(msg.model_dump(exclude_none=True, exclude={"refusal", "annotations", "audio"}))
                if not msg.tool_calls:
                    break
                messages += [{"role": "tool", "tool_call_id": c.id, "content": SCRIPT[min(turn, 1)][1]}
                             for c in msg.tool_calls]
            assert len(kiln_calls[ep]) == 3
            r = httpx.post(f"{base}/kiln/episodes/{ids[ep]}/reward", headers=AUTH,
                           json={"reward": 1.0 if ep == "a" else 0.0, "group_id": "g", "group_size": 2})
            assert r.status_code == 200, r.text
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    trajs = [Trajectory.from_dict(r) for r in rows]
    assert [r["group_size"] for r in rows] == [2, 2]
    for traj, ep in zip(trajs, ("a", "b")):
        sampled = [t for t, m in zip(traj.tokens, traj.loss_mask) if m]
        assert sampled == [t for k in kiln_calls[ep] for t in k["token_ids"]]
        assert [lp for lp, m in zip(traj.logp_infer, traj.loss_mask) if m] == \
            [lp for k in kiln_calls[ep] for lp in k["logprobs"]]

    from kiln.services.trainer.config import OptimizerConfig, TrainerConfig
    from kiln.services.trainer.engine import TrainerEngine
    from kiln.services.trainer.loop import InMemoryPublisher, ListBatchSource, StageSettings, run_stage

    engine = TrainerEngine(TrainerConfig(model_dir=model_dir, micro_batch_size=2,
                                         optimizer=OptimizerConfig(lr=1e-3)))
    before = {k: v.clone() for k, v in engine.named_hf_tensors()}
    res = run_stage(engine, ListBatchSource(trajs), InMemoryPublisher(),
                    StageSettings(kind="rl", max_steps=1, batch_size=2))
    [m] = res.metrics
    # The trainer's log-probs of the sampled tokens are vLLM's: no mismatch to speak of.
    assert m.mismatch_abs < 1e-3 and m.ratio_mask_frac == 0.0
    assert any(not torch.equal(before[k], v) for k, v in engine.named_hf_tensors())


def test_kiln_serve_refuses_what_it_cannot_serve(tmp_path: Path, capsys) -> None:
    from kiln.cli.main import main
    from kiln.models.tiny import make_tiny_checkpoint

    keys = tmp_path / "keys"
    keys.write_text(KEY + "\n")
    assert main(["serve", str(tmp_path), "--openai-port", "0", "--api-key-file", str(keys)]) == 1
    assert "holds no config.json" in capsys.readouterr().err
    head16 = make_tiny_checkpoint(tmp_path / "h16", hidden_size=64, num_heads=4, num_kv_heads=2)
    capsys.readouterr()  # the checkpoint writer's progress bar
    assert main(["serve", str(head16), "--openai-port", "0", "--api-key-file", str(keys)]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "head size 16" in err
