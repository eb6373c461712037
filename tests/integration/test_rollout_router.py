"""The rollout fleet's router in front of real OpenAI endpoints: two replicas (two servers with
their own episodes over one plain-transformers engine, as two rollout processes would have
their own), the router between them and the official `openai` client, all in one event loop.

What it must hold: an episode's calls reach the replica that opened it, new episodes go to the
least loaded replica, a stock client's conversation stays on one replica, an episode whose
replica is gone gets a retryable 503 naming it (never a silent 404), a draining replica gets
no new episodes, and nobody without a key gets through.
"""
from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path

import aiohttp
import httpx
import pytest
from openai import AsyncOpenAI
from transformers import AutoTokenizer

from kiln.services.rollout.engine import EngineSettings
from kiln.services.rollout.formats import make_format
from kiln.services.rollout.openai_auth import ApiKeys
from kiln.services.rollout.openai_episodes import ExternalEpisodes
from kiln.services.rollout.openai_server import REPLICA_HEADER, OpenAIServer
from kiln.services.rollout.router import Replicas, Router, conversation_root, serve
from kiln.services.rollout.torch_engine import TorchEngine
from helpers.toolcall_model import PROMPT, SCRIPT, TOOLS, shared_toolcall_model

KEY = "router-key-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return shared_toolcall_model(tmp_path_factory)


class Fleet:
    """Two replicas and a router; `stored[i]`: what replica i's reward calls stored."""

    def __init__(self, servers, stored, replicas: Replicas, base: str, urls: set[str]) -> None:
        self.servers, self.stored, self.replicas, self.base = servers, stored, replicas, base
        self.urls = urls
        """What discovery finds (a scenario may take one away)."""

    def instance(self, i: int) -> str:
        return self.servers[i].instance


async def _fleet(model_dir: Path, scenario):
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    engine = await TorchEngine.start(EngineSettings(model=str(model_dir), dtype="float32"))
    servers, stored = [], []
    for i in range(2):
        sink_list: list = []

        async def sink(trajs, size, out=sink_list):
            out.extend((t, size) for t in trajs)

        episodes = ExternalEpisodes(engine, make_format("hermes", tok), sink,
                                    max_tokens_per_turn=40, max_total_tokens=400)
        servers.append(OpenAIServer(episodes, model_name="tiny", tokenizer=tok,
                                    keys=ApiKeys({KEY: "test"}), replica=f"rollout-{i}"))
        stored.append(sink_list)
    urls = {f"http://127.0.0.1:{await s.start()}" for s in servers}

    async def discover() -> set[str]:
        return urls

    async with aiohttp.ClientSession(auto_decompress=False) as session:
        replicas = Replicas(discover, session, interval=0.2)
        await replicas.refresh()
        runner, port = await serve(Router(replicas, ApiKeys({KEY: "test"})), "127.0.0.1", 0)
        fleet = Fleet(servers, stored, replicas, f"http://127.0.0.1:{port}/v1", urls)
        try:
            return await scenario(fleet)
        finally:
            await runner.cleanup()
            for s in servers:
                await s.stop()
            await engine.close()


async def _open(http: httpx.AsyncClient, base: str) -> tuple[str, str]:
    r = await http.post(f"{base}/kiln/episodes", headers=AUTH)
    assert r.status_code == 201, r.text
    return r.json()["episode_id"], r.headers[REPLICA_HEADER]


async def _play(client: AsyncOpenAI, episode: str | None, turns: int = 3, between=None) -> list:
    """The scaffold: up to `turns` calls, each with the tool outputs of SCRIPT; the raw
    responses (their headers say which replica served each call). `between(raw)` is awaited
    after the first call."""
    messages: list[dict] = [{"role": "user", "content": PROMPT}]
    raws = []
    extra = {"X-Kiln-Episode": episode} if episode else {}
    for turn in range(turns):
        raw = await client.chat.completions.with_raw_response.create(
            model="tiny", messages=messages, tools=TOOLS, temperature=1.0, extra_headers=extra)
        raws.append(raw)
        if turn == 0 and between is not None:
            await between(raw)
        msg = raw.parse().choices[0].message
        messages.append(msg.model_dump(exclude_none=True, exclude={"refusal", "annotations", "audio"}))
        for call in msg.tool_calls or []:
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": SCRIPT[min(turn, len(SCRIPT) - 1)][1]})
        if not msg.tool_calls:
            break
    return raws


def test_episodes_stick_to_their_replica_and_spread_by_load(model_dir: Path) -> None:
    async def scenario(fleet: Fleet):
        async with httpx.AsyncClient() as http, \
                AsyncOpenAI(base_url=fleet.base, api_key=KEY, max_retries=0) as client:
            opened = [await _open(http, fleet.base) for _ in range(8)]
            games = await asyncio.gather(*(_play(client, ep) for ep, _ in opened))
            rewards = [await http.post(f"{fleet.base}/kiln/episodes/{ep}/reward", headers=AUTH,
                                       json={"reward": 1.0, "group_id": ep, "group_size": 1})
                       for ep, _ in opened]
        return opened, games, rewards

    opened, games, rewards = asyncio.run(_fleet(model_dir, scenario))
    # Opened one after another, each to the replica with fewer open episodes: 4 and 4.
    assert Counter(inst for _, inst in opened) == Counter({i: 4 for i in {o[1] for o in opened}})
    assert len({inst for _, inst in opened}) == 2
    for (episode, inst), raws in zip(opened, games):
        assert episode.endswith("." + inst)
        assert [r.headers[REPLICA_HEADER] for r in raws] == [inst] * len(raws)
    assert all(r.status_code == 200 for r in rewards), [r.text for r in rewards]


def test_a_stock_clients_conversation_stays_on_one_replica(model_dir: Path) -> None:
    async def scenario(fleet: Fleet):
        async def crowd(raw) -> None:
            # After the first turn its replica becomes the busier one by far: the rest of the
            # conversation must stay there all the same (placed by content, not by load).
            busy = next(s for s in fleet.servers if s.instance == raw.headers[REPLICA_HEADER])
            for _ in range(6):
                busy.episodes.open("test")
            await fleet.replicas.refresh()

        async with AsyncOpenAI(base_url=fleet.base, api_key=KEY, max_retries=0) as client:
            return await _play(client, None, between=crowd)

    raws = asyncio.run(_fleet(model_dir, scenario))
    assert len(raws) == 3
    assert len({r.headers[REPLICA_HEADER] for r in raws}) == 1
    # The replica found its issued episode again on every turn.
    assert len({r.parse().model_extra["kiln"]["episode_id"] for r in raws}) == 1
    # The root is the tools and the messages up to the first user turn, whatever follows.
    first = {"tools": TOOLS, "messages": [{"role": "user", "content": PROMPT}]}
    later = {"tools": TOOLS, "messages": first["messages"] + [{"role": "assistant", "content": "x"}]}
    assert conversation_root(first) == conversation_root(later)
    assert conversation_root(first) != conversation_root({**first, "tools": []})


def test_an_episode_whose_replica_is_gone_gets_a_retryable_503_and_new_ones_go_elsewhere(
        model_dir: Path) -> None:
    async def scenario(fleet: Fleet):
        async with httpx.AsyncClient() as http:
            opened = [await _open(http, fleet.base) for _ in range(2)]
            lost = next(ep for ep, inst in opened if inst == fleet.instance(1))
            await fleet.servers[1].stop()  # the replica's process is gone
            call = await http.post(f"{fleet.base}/chat/completions", headers={
                **AUTH, "X-Kiln-Episode": lost}, json={
                "model": "tiny", "messages": [{"role": "user", "content": PROMPT}]})
            reward = await http.post(f"{fleet.base}/kiln/episodes/{lost}/reward", headers=AUTH,
                                     json={"reward": 1.0, "group_size": 1})
            after = [await _open(http, fleet.base) for _ in range(3)]
            health = (await http.get(f"{fleet.base.removesuffix('/v1')}/healthz")).json()
        return call, reward, after, health, fleet.instance(0), fleet.instance(1)

    call, reward, after, health, alive, gone = asyncio.run(_fleet(model_dir, scenario))
    for r in (call, reward):
        assert r.status_code == 503 and r.headers["Retry-After"] == "1", r.text
        error = r.json()["error"]
        assert error["code"] == "replica_gone" and gone in error["message"]
    assert [inst for _, inst in after] == [alive] * 3
    assert {r["instance"]: r["state"] for r in health["replicas"]} == {alive: "serving", gone: "down"}


def test_a_draining_replica_gets_no_new_episodes_and_finishes_its_open_ones(model_dir: Path) -> None:
    async def scenario(fleet: Fleet):
        async with httpx.AsyncClient() as http, \
                AsyncOpenAI(base_url=fleet.base, api_key=KEY, max_retries=0) as client:
            opened = [await _open(http, fleet.base) for _ in range(2)]
            kept = next(ep for ep, inst in opened if inst == fleet.instance(1))
            fleet.servers[1].drain()
            await fleet.replicas.refresh()
            after = [await _open(http, fleet.base) for _ in range(3)]
            raws = await _play(client, kept)
            direct = await http.post(f"http://127.0.0.1:{fleet.servers[1].port}/v1/kiln/episodes",
                                     headers=AUTH)
        return after, raws, direct, fleet.instance(0), fleet.instance(1)

    after, raws, direct, alive, draining = asyncio.run(_fleet(model_dir, scenario))
    assert [inst for _, inst in after] == [alive] * 3
    assert raws and {r.headers[REPLICA_HEADER] for r in raws} == {draining}
    assert direct.status_code == 503 and direct.json()["error"]["code"] == "replica_draining"


def test_a_replica_no_longer_discovered_drains_while_it_answers(model_dir: Path) -> None:
    """A pod gone from the Service's endpoints (scaled down, terminating) still holds its open
    episodes: the router keeps it, as draining, until it stops answering."""
    async def scenario(fleet: Fleet):
        async with httpx.AsyncClient() as http, \
                AsyncOpenAI(base_url=fleet.base, api_key=KEY, max_retries=0) as client:
            opened = [await _open(http, fleet.base) for _ in range(2)]
            leaving = fleet.servers[1]
            kept = next(ep for ep, inst in opened if inst == leaving.instance)
            fleet.urls.discard(f"http://127.0.0.1:{leaving.port}")
            await fleet.replicas.refresh()
            states = {r.instance: r.state() for r in fleet.replicas.known.values()}
            after = [inst for _, inst in [await _open(http, fleet.base) for _ in range(2)]]
            raws = await _play(client, kept)
            await leaving.stop()
            await fleet.replicas.refresh()
            left = {r.instance for r in fleet.replicas.known.values()}
        return states, after, raws, left, fleet.instance(0), leaving.instance

    states, after, raws, left, alive, leaving = asyncio.run(_fleet(model_dir, scenario))
    assert states == {alive: "serving", leaving: "draining"}
    assert after == [alive, alive]
    assert {r.headers[REPLICA_HEADER] for r in raws} == {leaving}
    assert left == {alive}  # neither discovered nor answering: forgotten


def test_the_router_refuses_callers_without_a_key_and_names_unknown_ids(model_dir: Path) -> None:
    async def scenario(fleet: Fleet):
        async with httpx.AsyncClient() as http:
            anonymous = await http.post(f"{fleet.base}/kiln/episodes")
            wrong = await http.get(f"{fleet.base}/models", headers={"Authorization": "Bearer nope"})
            forged = await http.post(f"{fleet.base}/kiln/episodes/ep-123/reward", headers=AUTH,
                                     json={"reward": 1.0})
            models = await http.get(f"{fleet.base}/models", headers=AUTH)
            opened = sum(len(s.episodes) for s in fleet.servers)
        return anonymous, wrong, forged, models, opened

    anonymous, wrong, forged, models, opened = asyncio.run(_fleet(model_dir, scenario))
    assert anonymous.status_code == wrong.status_code == 401
    assert opened == 0  # nothing reached a replica
    assert forged.status_code == 404 and "not open" in forged.json()["error"]["message"]
    assert models.status_code == 200 and models.json()["data"][0]["id"] == "tiny"


def test_replicas_are_found_by_announcement_files_or_by_dns(tmp_path: Path) -> None:
    from kiln.services.rollout.router_main import _parser, discovery

    (tmp_path / "rollout").mkdir()
    (tmp_path / "rollout-1").mkdir()
    (tmp_path / "rollout" / "openai.json").write_text('{"url": "http://127.0.0.1:8001/"}')
    (tmp_path / "rollout-1" / "openai.json").write_text('{"url": ')  # being written
    files = discovery(_parser().parse_args(
        ["--port", "0", "--discover-files", str(tmp_path / "rollout*" / "openai.json")]))
    dns = discovery(_parser().parse_args(["--port", "0", "--discover-dns", "localhost:8000"]))
    found = asyncio.run(files())
    assert found == {"http://127.0.0.1:8001"}
    assert "http://127.0.0.1:8000" in asyncio.run(dns())
    with pytest.raises(ValueError, match="HOST:PORT"):
        discovery(_parser().parse_args(["--port", "0", "--discover-dns", "rollout"]))


def test_a_streamed_reply_comes_through_the_router_as_events(model_dir: Path) -> None:
    async def scenario(fleet: Fleet):
        async with AsyncOpenAI(base_url=fleet.base, api_key=KEY, max_retries=0) as client:
            stream = await client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": PROMPT}], tools=TOOLS,
                stream=True)
            return [chunk async for chunk in stream]

    chunks = asyncio.run(_fleet(model_dir, scenario))
    assert chunks and chunks[-1].choices[0].finish_reason in ("stop", "tool_calls", "length")
    assert chunks[0].choices[0].delta.role == "assistant"
