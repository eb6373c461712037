"""The OpenAI endpoint driven as stock agent clients drive it, with the official `openai` client:
every sampling field checked before the engine sees it (OpenAI's error shape, the field named,
the client's own exception classes), another model's name a 404, context overflow worded as
vLLM's, episodes issued by the server to clients that name none, a failed call that leaves its
episode as it was, special tokens kept out of replies, and an engine that dies or wedges making
/healthz fail.

In-process servers on the plain-transformers engine and the tiny tool-calling model, except
where the point is an engine failure: there a scripted engine (below) fails on cue, since a
real one cannot be made to die on demand. The slow test runs `kiln serve` (vLLM) and bursts
128 concurrent seeded requests at it, which killed vLLM's engine on a CPU before seeds were
dropped there.
"""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from openai import AsyncOpenAI, BadRequestError, InternalServerError, NotFoundError, OpenAI

from helpers.openai_serving import KEY, OTHER, serve
from helpers.toolcall_model import PROMPT, SCRIPT, TOOLS, shared_toolcall_model

ROOT = Path(__file__).resolve().parents[2]
USER = [{"role": "user", "content": PROMPT}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return shared_toolcall_model(tmp_path_factory)


BAD = [  # (field, value) that vLLM's server (or the API's ranges) refuses, or that is not done here
    ("seed", "abc"), ("seed", 2 ** 70), ("seed", 1.5), ("temperature", 5), ("temperature", "hot"),
    ("temperature", -0.1), ("top_p", 0), ("top_p", 1.5), ("max_tokens", 0), ("max_tokens", "10"),
    ("max_completion_tokens", -1), ("n", 2), ("n", 0), ("stop", ["\n"]), ("stop", "END"),
    ("top_logprobs", 3), ("top_logprobs", 99), ("presence_penalty", 0.5), ("frequency_penalty", 1),
    ("presence_penalty", 3), ("top_k", 5), ("min_p", 0.1), ("repetition_penalty", 1.2),
    ("logit_bias", {"5": 10}), ("response_format", {"type": "json_object"}),
    ("tool_choice", "required"), ("tool_choice", "none"),
    ("tool_choice", {"type": "function", "function": {"name": "bash"}}), ("stream", "yes"),
    ("logprobs", 1), ("parallel_tool_calls", False), ("user", 7),
]


def test_every_bad_sampling_field_gets_a_400_naming_it_and_never_reaches_the_engine(model_dir: Path) -> None:
    async def scenario(client, http, ctx):
        refused = {}
        for field, value in BAD:
            try:
                await client.chat.completions.create(model="tiny", messages=USER,
                                                     extra_body={field: value})
            except BadRequestError as exc:
                refused[(field, json.dumps(value))] = exc.body
        calls_before = ctx["engine"].calls
        try:
            await client.chat.completions.create(model="gpt-4o", messages=USER)
        except NotFoundError as exc:
            missing = exc.body
        models = [(await http.get(p)).status_code for p in ("/models/tiny", "/models/gpt-4o")]
        other = await http.post("/completions", json={"model": "tiny", "prompt": "hi"})
        # Defaults and "off" values pass; the server still answers.
        ok = await client.chat.completions.create(
            model="tiny", messages=USER, seed=3, temperature=0, top_p=1, presence_penalty=0,
            n=1, stop=[], top_logprobs=0, response_format={"type": "text"}, tool_choice="auto",
            max_tokens=8, logprobs=True, user="alice", extra_body={"top_k": -1})
        return refused, calls_before, missing, models, other, ok, ctx["engine"].calls

    refused, calls_before, missing, models, other, ok, calls = serve(model_dir, scenario, scripted=True)
    assert sorted(refused) == sorted((f, json.dumps(v)) for f, v in BAD)
    for (field, _), body in refused.items():
        assert set(body) == {"message", "type", "param", "code"}, body
        assert body["param"] == field and body["message"].startswith(field + ":"), body
    assert calls_before == 0  # nothing refused reached the engine
    assert missing["param"] == "model" and missing["message"].startswith("The model `gpt-4o` does not exist")
    assert models == [200, 404]
    assert other.status_code == 404 and "chat/completions" in other.json()["error"]["message"]
    assert ok.choices[0].message.content == "Done." and calls == 1


def test_context_overflow_is_worded_as_vllm_words_it(model_dir: Path) -> None:
    async def scenario(client, http, ctx):
        errors = []
        for kw in ({"max_tokens": 1000},
                   {"messages": [{"role": "user", "content": "word " * 500}]}):
            try:
                await client.chat.completions.create(**{"model": "tiny", "messages": USER, **kw})
            except BadRequestError as exc:
                errors.append(exc.body)
        return errors

    errors = serve(model_dir, scenario, scripted=True)
    assert len(errors) == 2
    for body in errors:
        # litellm maps this sentence (and the code) to ContextWindowExceededError.
        assert body["message"].startswith("This model's maximum context length is 400 tokens. "
                                          "However, you requested "), body
        assert body["code"] == "context_length_exceeded"


def test_a_failed_call_leaves_the_episode_as_it_was_and_its_retry_continues(model_dir: Path) -> None:
    """Both SDKs retry a failed call on their own; the retry must continue the episode exactly
    as if the failure had not happened (it used to get 422 for the rest of the episode)."""
    async def play(client, http, ctx, fail_on):
        ctx["engine"].fail_on = fail_on
        ep = (await http.post("/kiln/episodes")).json()["episode_id"]
        messages, statuses = list(USER), []
        for turn in range(3):
            while True:
                try:
                    resp = await client.chat.completions.create(
                        model="tiny", messages=messages, extra_headers={"X-Kiln-Episode": ep})
                    statuses.append(200)
                    break
                except InternalServerError as exc:
                    statuses.append(exc.status_code)
            messages += [resp.choices[0].message.model_dump(exclude_none=True, include={"role", "content"}),
                         {"role": "user", "content": f"and then {turn}?"}]
        r = await http.post(f"/kiln/episodes/{ep}/reward", json={"reward": 1.0})
        assert r.status_code == 200, r.text
        return statuses

    def run(fail_on):
        async def scenario(client, http, ctx):
            return await play(client, http, ctx, fail_on), ctx["stored"]
        return serve(model_dir, scenario, scripted=True)

    clean, [(clean_traj, _)] = run(set())
    statuses, [(traj, _)] = run({2, 4})
    assert clean == [200] * 3 and statuses == [200, 500, 200, 500, 200]
    assert traj.tokens == clean_traj.tokens and traj.loss_mask == clean_traj.loss_mask


def test_episodes_are_issued_to_clients_that_name_none_and_found_again(model_dir: Path) -> None:
    """A stock client sends no episode: the server issues one, says which in a header and the
    body, and finds it again from the conversation the client sends back. `user` (an end-user
    id) never names an episode: two conversations of one user are two episodes."""
    async def scenario(client, http, ctx):
        ids, messages = [], list(USER)
        for turn in range(3):
            raw = await client.chat.completions.with_raw_response.create(
                model="tiny", messages=messages, tools=TOOLS, temperature=0, user="alice")
            resp = raw.parse()
            assert raw.headers["X-Kiln-Episode"] == resp.model_extra["kiln"]["episode_id"]
            ids.append(raw.headers["X-Kiln-Episode"])
            msg = resp.choices[0].message
            messages.append(msg.model_dump(exclude_none=True, exclude={"refusal", "annotations", "audio"}))
            if not msg.tool_calls:
                break
            messages += [{"role": "tool", "tool_call_id": c.id, "content": SCRIPT[min(turn, 1)][1]}
                         for c in msg.tool_calls]
        other = await client.chat.completions.with_raw_response.create(
            model="tiny", messages=USER, tools=TOOLS, temperature=0, user="alice")
        # Another key sending the same conversation gets an episode of its own: conversations
        # are matched within a key, so no caller can write into another's episode.
        stranger = await http.post("/chat/completions", headers={"Authorization": f"Bearer {OTHER}"},
                                   json={"model": "tiny", "messages": messages, "tools": TOOLS})
        r = await http.post(f"/kiln/episodes/{ids[0]}/reward", json={"reward": 1.0})
        return ids, other.headers["X-Kiln-Episode"], stranger.headers["X-Kiln-Episode"], r, ctx["stored"]

    ids, other, stranger, r, stored = serve(model_dir, scenario)
    assert len(ids) == 3 and len(set(ids)) == 1 and ids[0].startswith("ep-")
    assert other != ids[0] and stranger not in ids
    assert r.status_code == 200
    [(traj, _)] = stored  # the three calls are one exact trajectory
    assert "segment:1" not in traj.flags and sum(traj.loss_mask) > 0


def test_special_tokens_are_kept_out_of_the_reply_but_trained_on(model_dir: Path) -> None:
    async def scenario(client, http, ctx):
        tok, engine = ctx["tok"], ctx["engine"]
        engine.reply = (tok.encode("Do", add_special_tokens=False) + [tok.convert_tokens_to_ids("<|pad|>")]
                        + tok.encode("ne.", add_special_tokens=False) + engine.reply[-1:])
        ep = (await http.post("/kiln/episodes")).json()["episode_id"]
        resp = await client.chat.completions.create(model="tiny", messages=USER,
                                                    extra_headers={"X-Kiln-Episode": ep})
        return resp, engine.reply

    resp, sampled = serve(model_dir, scenario, scripted=True)
    assert resp.choices[0].message.content == "Done."
    assert resp.model_extra["kiln"]["token_ids"] == sampled


def test_a_dead_or_wedged_engine_fails_healthz_and_calls_on_dead(model_dir: Path) -> None:
    async def died(client, http, ctx):
        assert (await http.get(ctx["health"])).status_code == 200
        ctx["engine"].fail_on, ctx["engine"].dead = {1}, "the engine core exited"
        failed = await http.post("/chat/completions", json={"model": "tiny", "messages": USER})
        return failed, await http.get(ctx["health"])

    dead: list[str] = []
    failed, health = serve(model_dir, died, scripted=True, on_dead=dead.append)
    assert failed.status_code == 503 and failed.json()["error"]["type"] == "server_error"
    assert health.status_code == 503 and dead == ["the engine core exited"]

    async def wedged(client, http, ctx):
        ctx["engine"].hanging = True
        stuck = asyncio.ensure_future(http.post("/chat/completions", json={"model": "tiny", "messages": USER}))
        deadline = time.monotonic() + 60
        while (health := await http.get(ctx["health"])).status_code == 200:
            assert time.monotonic() < deadline, "a wedged engine never failed /healthz"
            await asyncio.sleep(0.1)
        ctx["engine"].hang.set()
        await stuck
        return health

    dead.clear()
    health = serve(model_dir, wedged, scripted=True, on_dead=dead.append, stall_seconds=0.5)
    assert health.status_code == 503 and "wedged" in health.json()["reason"] and len(dead) == 1


def test_kiln_serve_refuses_a_template_that_drops_tools(model_dir: Path, tmp_path: Path, capsys) -> None:
    """A chat template without tools, even with an explicit --tool-call-format, is refused with
    the reason (it used to serve, dropping every request's tools from the prompt)."""
    import shutil

    from kiln.cli.main import main

    plain = tmp_path / "plain"
    shutil.copytree(model_dir, plain)
    (plain / "chat_template.jinja").write_text(
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    (tmp_path / "keys").write_text(KEY + "\n")
    for fmt in ("auto", "hermes"):
        assert main(["serve", str(plain), "--openai-port", "0", "--engine", "torch",
                     "--api-key-file", str(tmp_path / "keys"), "--tool-call-format", fmt]) == 1
        assert "does not render tools" in capsys.readouterr().err


@pytest.mark.slow
def test_kiln_serve_survives_stock_clients(model_dir: Path, tmp_path: Path) -> None:
    """`kiln serve` (vLLM, its own process) with the official client: 128 concurrent seeded
    requests (vLLM's CPU engine died of them: "CPU Generator does not use offset"), a string
    seed, then a plain request, a tool call and the client's exception classes."""
    ready = tmp_path / "ready.json"
    (tmp_path / "keys").write_text(KEY + "\n")
    # The server's output goes to a file: a pipe nobody reads would block it once full.
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "kiln.cli.main", "serve", str(model_dir), "--openai-port", "0",
         "--ready-file", str(ready), "--max-tokens-per-turn", "40",
         "--api-key-file", str(tmp_path / "keys")],
        cwd=tmp_path, env=os.environ.copy(), stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while not ready.exists():
            assert proc.poll() is None and time.monotonic() < deadline, \
                (tmp_path / "serve.log").read_text()[-3000:]
            time.sleep(0.5)
        base = f"http://127.0.0.1:{json.loads(ready.read_text())['port']}/v1"

        async def burst():
            limits = httpx.Limits(max_connections=136)
            async with AsyncOpenAI(base_url=base, api_key=KEY, max_retries=0,
                                   http_client=httpx.AsyncClient(limits=limits, timeout=600)) as client:
                # Prompts of many lengths, so that prefills are split across engine steps.
                return await asyncio.gather(*(client.chat.completions.create(
                    model="m", seed=i, max_tokens=8,
                    messages=[{"role": "user", "content": PROMPT + " again" * (i % 40)}])
                    for i in range(128)), return_exceptions=True)

        results = asyncio.run(burst())
        failed = [r for r in results if isinstance(r, BaseException)]
        assert not failed, (len(failed), failed[:2], (tmp_path / "serve.log").read_text()[-3000:])
        client = OpenAI(base_url=base, api_key=KEY, max_retries=0)
        with pytest.raises(BadRequestError) as refused:
            client.chat.completions.create(model="m", messages=USER, extra_body={"seed": "abc"})
        assert refused.value.body["param"] == "seed"
        with pytest.raises(NotFoundError):
            client.chat.completions.create(model="gpt-4o", messages=USER)
        plain = client.chat.completions.create(model="m", messages=USER, tools=TOOLS, temperature=0)
        [call] = plain.choices[0].message.tool_calls
        assert json.loads(call.function.arguments) == {"command": "ls"}
        assert httpx.get(f"{base.removesuffix('/v1')}/healthz").status_code == 200
        proc.terminate()
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.terminate()  # a clean stop also ends vLLM's engine process, a kill orphans it
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.close()
