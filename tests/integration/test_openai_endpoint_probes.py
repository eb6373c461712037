"""The OpenAI endpoint's door, probed as an attacker would: API keys on every route, episodes
bound to the key that opened them, rewards that must be finite and in range, group sizes that
must be the stage's, and the caps on bodies, open episodes and idle time.

One in-process server per test (the plain-transformers engine on the tiny tool-calling model);
requests are plain HTTP, so that what goes over the wire is exactly what the test says.
"""
from __future__ import annotations

import asyncio
import math
import os
from pathlib import Path

import httpx
import pytest
from transformers import AutoTokenizer

from kiln.api.openai_endpoint import OpenAIEndpointSpec
from kiln.services.rollout.engine import EngineSettings
from kiln.services.rollout.formats import make_format
from kiln.services.rollout.openai_auth import ApiKeys, write_key
from kiln.services.rollout.openai_episodes import ExternalEpisodes
from kiln.services.rollout.openai_server import OpenAIServer
from kiln.services.rollout.torch_engine import TorchEngine
from helpers.toolcall_model import PROMPT, TOOLS, shared_toolcall_model

A, B = "key-a-0123456789abcdef", "key-b-0123456789abcdef"


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return shared_toolcall_model(tmp_path_factory)


def serve(model_dir: Path, scenario, *, stage_group_size=None, **settings):
    """Run `await scenario(http, stored, server)` against a server with keys A and B; its result."""
    async def main():
        tok = AutoTokenizer.from_pretrained(str(model_dir))
        engine = await TorchEngine.start(EngineSettings(model=str(model_dir), dtype="float32"))
        stored: list = []

        async def sink(trajs, size):
            stored.extend((t, size) for t in trajs)

        episodes = ExternalEpisodes(engine, make_format("hermes", tok), sink, max_tokens_per_turn=8,
                                    max_total_tokens=400, settings=OpenAIEndpointSpec(**settings),
                                    stage_group_size=stage_group_size)
        server = OpenAIServer(episodes, model_name="tiny", tokenizer=tok,
                              keys=ApiKeys({A: "a", B: "b"}))
        port = await server.start()
        try:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}/v1", timeout=60) as http:
                return await scenario(http, stored, server)
        finally:
            await server.stop()
            await engine.close()
    return asyncio.run(main())


async def opened(http: httpx.AsyncClient, key: str = A) -> str:
    r = await http.post("/kiln/episodes", headers=auth(key))
    assert r.status_code == 201, r.text
    return r.json()["episode_id"]


async def turn(http: httpx.AsyncClient, episode: str, key: str = A) -> httpx.Response:
    return await http.post("/chat/completions", headers={**auth(key), "X-Kiln-Episode": episode},
                           json={"model": "tiny", "messages": [{"role": "user", "content": PROMPT}],
                                 "tools": TOOLS})


def test_anonymous_and_unknown_keys_get_401_on_every_route(model_dir: Path) -> None:
    async def scenario(http, stored, server):
        ep = await opened(http)
        routes = [("POST", "/kiln/episodes", None), ("GET", "/models", None),
                  ("POST", "/chat/completions", {"model": "tiny", "user": ep,
                                                 "messages": [{"role": "user", "content": "hi"}]}),
                  ("POST", f"/kiln/episodes/{ep}/reward", {"reward": 1.0}),
                  ("DELETE", f"/kiln/episodes/{ep}", None)]
        out = []
        for headers in ({}, auth("not-a-key-of-this-server"), {"Authorization": A},
                        {"Authorization": "Basic " + A}):
            for method, path, body in routes:
                r = await http.request(method, path, json=body, headers=headers)
                out.append((method, path, r.status_code, r.headers.get("WWW-Authenticate")))
        health = await http.get(str(http.base_url).removesuffix("/v1/") + "/healthz")
        models = await http.get("/models", headers=auth(B))
        return out, health, models, ep in server.episodes._episodes

    out, health, models, still_open = serve(model_dir, scenario)
    assert {(s, w) for _, _, s, w in out} == {(401, "Bearer")}, out
    assert len(out) == 20
    # Liveness and what the fleet's router places episodes by: counts, never an episode.
    assert health.status_code == 200 and health.json()["ok"] is True
    assert set(health.json()) == {"ok", "instance", "draining", "open_episodes", "in_flight"}
    assert models.status_code == 200 and models.json()["data"][0]["id"] == "tiny"
    assert still_open  # nothing anonymous touched it


def test_a_key_cannot_reward_continue_or_delete_another_keys_episode(model_dir: Path) -> None:
    async def scenario(http, stored, server):
        ep = await opened(http, A)
        assert (await turn(http, ep, A)).status_code == 200
        theirs = [(await http.post(f"/kiln/episodes/{ep}/reward", headers=auth(B),
                                   json={"reward": 1.0})).status_code,
                  (await http.delete(f"/kiln/episodes/{ep}", headers=auth(B))).status_code,
                  (await turn(http, ep, B)).status_code]
        made_up = (await turn(http, "ep-made-up-by-the-caller", A)).status_code
        mine = await http.post(f"/kiln/episodes/{ep}/reward", headers=auth(A),
                               json={"reward": 1.0, "group_id": "g", "group_size": 1})
        return theirs, made_up, mine, list(stored)

    theirs, made_up, mine, stored = serve(model_dir, scenario)
    assert theirs == [404, 404, 404] and made_up == 404
    assert mine.status_code == 200, mine.text
    [(traj, size)] = stored
    # The owner's reward, in the owner's own group namespace.
    assert traj.reward == 1.0 and size == 1 and traj.group_id.endswith("/g")
    assert traj.group_id != "g"


@pytest.mark.parametrize("raw", [b'{"reward": 1e300}', b'{"reward": NaN}', b'{"reward": Infinity}',
                                 b'{"reward": -Infinity}', b'{"reward": 10.5}', b'{"reward": true}',
                                 b'{"reward": 1.0, "reward_parts": {"tests": NaN}}'])
def test_a_bad_reward_gets_400_and_the_episode_survives(model_dir: Path, raw: bytes) -> None:
    async def scenario(http, stored, server):
        ep = await opened(http)
        assert (await turn(http, ep)).status_code == 200
        bad = await http.post(f"/kiln/episodes/{ep}/reward", content=raw,
                              headers={**auth(A), "Content-Type": "application/json"})
        good = await http.post(f"/kiln/episodes/{ep}/reward", headers=auth(A),
                               json={"reward": 0.5, "reward_parts": {"tests": 0.5}})
        return bad, good, list(stored)

    bad, good, stored = serve(model_dir, scenario)
    assert bad.status_code == 400, bad.text
    assert bad.json()["error"]["message"].startswith(("reward:", "reward_parts:"))
    assert good.status_code == 200, good.text
    [(traj, _)] = stored
    assert traj.reward == 0.5 and traj.reward_parts == {"tests": 0.5}
    assert all(math.isfinite(x) for x in (traj.reward, *traj.reward_parts.values()))


def test_group_sizes_must_be_the_stages(model_dir: Path) -> None:
    async def scenario(http, stored, server):
        ep = await opened(http)
        assert (await turn(http, ep)).status_code == 200
        out = []
        for body in ({"reward": 1.0, "group_id": "g", "group_size": 2},
                     {"reward": 1.0, "group_size": 8},  # no group id: a group that never completes
                     {"reward": 1.0, "group_id": "g", "group_size": 8}):
            r = await http.post(f"/kiln/episodes/{ep}/reward", headers=auth(A), json=body)
            out.append((r.status_code, r.json().get("error", {}).get("message", "")))
        return out, list(stored)

    out, stored = serve(model_dir, scenario, stage_group_size=lambda: 8)
    assert [s for s, _ in out] == [400, 400, 200]
    assert out[0][1].startswith("group_size:") and out[1][1].startswith("group_id:")
    assert [size for _, size in stored] == [8]


def test_a_body_over_the_cap_gets_413(model_dir: Path) -> None:
    async def scenario(http, stored, server):
        offloaded = []
        offload = server.episodes.offload

        async def spy(fn, *args):
            offloaded.append(getattr(fn, "__name__", str(fn)))
            return await offload(fn, *args)

        server.episodes.offload = spy
        ep = await opened(http)
        body = {"model": "tiny", "max_tokens": 1,
                "messages": [{"role": "user", "content": "x" * (150 << 10)}]}
        named = {**auth(A), "X-Kiln-Episode": ep}
        over = await http.post("/chat/completions", headers=named, json=body)
        # Under the cap but over the offload threshold: parsed and rendered off the event loop.
        body["messages"][0]["content"] = "y" * (80 << 10)
        heavy = await http.post("/chat/completions", headers=named, json=body)
        return over, heavy, offloaded

    over, heavy, offloaded = serve(model_dir, scenario, max_body_bytes=128 << 10)
    assert over.status_code == 413 and "maxBodyBytes" in over.json()["error"]["message"]
    assert heavy.status_code != 413, heavy.text
    assert offloaded[:2] == ["loads", "_prepare"]


def test_too_many_open_episodes_get_429_per_key(model_dir: Path) -> None:
    async def scenario(http, stored, server):
        first = [await opened(http, A) for _ in range(2)]
        refused = await http.post("/kiln/episodes", headers=auth(A))
        other = await http.post("/kiln/episodes", headers=auth(B))  # its own allowance
        await http.delete(f"/kiln/episodes/{first[0]}", headers=auth(A))
        again = await http.post("/kiln/episodes", headers=auth(A))
        return refused, other, again

    refused, other, again = serve(model_dir, scenario, max_open_episodes=2)
    assert refused.status_code == 429 and "maxOpenEpisodes" in refused.json()["error"]["message"]
    assert other.status_code == 201 and again.status_code == 201


def test_idle_episodes_are_closed_and_free_their_slot(model_dir: Path) -> None:
    async def scenario(http, stored, server):
        ep = await opened(http)
        assert (await turn(http, ep)).status_code == 200
        await asyncio.sleep(0.6)  # the sweeper runs every idle_seconds / 4
        late = await http.post(f"/kiln/episodes/{ep}/reward", headers=auth(A), json={"reward": 1.0})
        slot = await http.post("/kiln/episodes", headers=auth(A))
        return late, slot, server.episodes.dropped_idle, list(stored)

    late, slot, dropped, stored = serve(model_dir, scenario, idle_seconds=0.2, max_open_episodes=1)
    assert late.status_code == 404 and dropped == 1 and stored == []
    assert slot.status_code == 201


def test_keys_files_and_folders(tmp_path: Path) -> None:
    path = tmp_path / "openai" / "api-key"
    key = write_key(path)
    assert path.stat().st_mode & 0o777 == 0o600 and write_key(path) == key  # kept on resume
    keys = ApiKeys.load(path)
    assert keys.identify(f"Bearer {key}") and keys.identify(f"bearer {key}")
    assert keys.identify(None) is None and keys.identify(key) is None
    assert keys.identify(f"Bearer {key}x") is None
    folder = tmp_path / "secret"
    folder.mkdir()
    (folder / "agents").write_text(A)
    (folder / "eval").write_text(B + "\n")
    both = ApiKeys.load(folder)
    assert both.identify(f"Bearer {A}") != both.identify(f"Bearer {B}") is not None
    with pytest.raises(ValueError, match="shorter than 16"):
        ApiKeys({"short": "x"})
    with pytest.raises(ValueError, match="at least one"):
        ApiKeys({})
    with pytest.raises(ValueError, match="does not exist"):
        ApiKeys.load(tmp_path / "missing")


def test_kiln_run_generates_a_private_key_and_says_where(tmp_path: Path, monkeypatch) -> None:
    from kiln.cli.local.openai_access import grant

    monkeypatch.delenv("KILN_OPENAI_HOST", raising=False)
    monkeypatch.delenv("KILN_OPENAI_API_KEYS", raising=False)
    said = grant(tmp_path, 8000)
    path = tmp_path / "openai" / "api-key"
    assert path.stat().st_mode & 0o777 == 0o600
    assert str(path) in said and "http://127.0.0.1:8000/v1" in said
    assert os.environ["KILN_OPENAI_API_KEYS"] == str(path)
    assert ApiKeys.from_env().identify(f"Bearer {path.read_text().strip()}") is not None
