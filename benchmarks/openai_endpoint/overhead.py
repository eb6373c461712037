"""The OpenAI endpoint's overhead per call against Kiln's own episode path, at N concurrent
episodes.

Both paths play the same 3-turn tool-using episode (the tiny tool-calling model of
tests/helpers/toolcall_model.py, tool outputs scripted) on one vLLM engine:
- baseline: the rollout's agent loop (`agent.run_episode`), which calls the engine directly and
  reaches the environment through the `EnvClient` interface (here an in-process script);
- openai: the official `openai` client (AsyncOpenAI) over HTTP against the rollout's
  `OpenAIServer`, whose `ExternalEpisodes` stitch the calls into a trajectory, then the reward
  call.
- http: the same requests as plain JSON with aiohttp, which isolates the endpoint from the
  `openai` client's own cost (that client runs in this process, on the same cores);
- http, client process: the same aiohttp client in a process of its own, as a scaffold is (in
  a sandbox, another pod or another machine): this process then spends only what the endpoint
  costs (HTTP server, episode bookkeeping, the engine's front end), and its event loop is not
  shared with the client's.
Prints one line per path (wall time, calls, this process's CPU time per call, mean and p50/p99
latency of a call) and the overhead per call of each against the baseline: (mean - baseline
mean) / baseline mean, and the endpoint's CPU time per call over the baseline's (what the
endpoint and its client cost, which the machine's load hardly moves; latency on a loaded
machine is mostly waiting for a core), with the load average at the end. Both
endpoint paths authenticate every call (`Authorization: Bearer`) and open each episode with
`POST /v1/kiln/episodes` first, as a scaffold must; the last line also gives the cost of the
key check alone: `GET /v1/models` (authenticated) against `GET /healthz` (not), sequentially.

    python benchmarks/openai_endpoint/overhead.py [--episodes 128] [--rounds 2] [--skip-openai]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))  # the tool-calling model the tests build

import httpx  # noqa: E402
from openai import AsyncOpenAI  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from kiln.episode import EpisodeInfo, Message, StepResult, ToolOutput  # noqa: E402
from kiln.services.rollout.agent import Limits, run_episode  # noqa: E402
from kiln.services.rollout.engine import EngineSettings, SamplingOptions, start_engine  # noqa: E402
from kiln.services.rollout.formats import make_format  # noqa: E402
from kiln.services.rollout.openai_auth import ApiKeys  # noqa: E402
from kiln.services.rollout.openai_episodes import ExternalEpisodes  # noqa: E402
from kiln.services.rollout.openai_server import OpenAIServer  # noqa: E402
from helpers.toolcall_model import BASH, PROMPT, SCRIPT, TOOLS, make_toolcall_model  # noqa: E402

TURNS = 3
KEY = "bench-key-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {KEY}"}


class ScriptEnv:
    """The episode's environment for the baseline: SCRIPT's outputs, then the end."""

    def __init__(self, latencies: list[float]) -> None:
        self.latencies, self._turn, self._t = latencies, {}, {}

    async def open(self, task_set, index, max_actions):
        eid = f"e{len(self._turn)}"
        self._turn[eid] = 0
        self._t[eid] = time.perf_counter()
        return EpisodeInfo(eid, "t", "script", [Message("user", PROMPT)], [BASH])

    async def step(self, episode_id, action):
        now = time.perf_counter()
        self.latencies.append(now - self._t[episode_id])  # since the previous call returned
        turn = self._turn[episode_id] = self._turn[episode_id] + 1
        self._t[episode_id] = time.perf_counter()
        if not action.tool_calls or turn >= TURNS:
            return StepResult(done=True, reward=1.0)
        return StepResult([ToolOutput(c.id, c.name, SCRIPT[min(turn - 1, 1)][1])
                           for c in action.tool_calls])

    async def close(self, episode_id):
        pass


def summary(name: str, wall: float, lat: list[float], cpu: float) -> dict:
    """`cpu`: this process's CPU seconds over the run (server, client and the engine's front
    end; the engine core is a process of its own): per call it barely moves with the machine's
    load, where latency on a loaded machine is mostly waiting for a core."""
    s = sorted(lat)
    return {"path": name, "wall_s": round(wall, 2), "calls": len(lat),
            "cpu_ms_per_call": round(cpu / len(lat) * 1000, 2),
            "mean_ms": round(statistics.fmean(lat) * 1000, 1),
            "p50_ms": round(s[len(s) // 2] * 1000, 1), "p99_ms": round(s[int(0.99 * (len(s) - 1))] * 1000, 1)}


async def baseline(engine, fmt, episodes: int) -> dict:
    lat: list[float] = []
    env = ScriptEnv(lat)
    t0, c0 = time.perf_counter(), time.process_time()
    await asyncio.gather(*[run_episode(engine, env, fmt, task_set="t", index=0,
                                       sampling=SamplingOptions(max_tokens=40),
                                       limits=Limits(max_turns=TURNS, max_tokens_per_turn=40,
                                                     max_total_tokens=400))
                           for _ in range(episodes)])
    return summary("baseline (agent loop)", time.perf_counter() - t0, lat, time.process_time() - c0)


async def via_http(base: str, episodes: int, tag: str) -> dict:
    """The same episodes as plain JSON over aiohttp: what the endpoint costs without the
    `openai` client's own per-call cost (its httpcore pool scans every connection per request,
    quadratic in concurrency, and runs in this process beside the server)."""
    import aiohttp

    lat: list[float] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=episodes + 8),
                                     headers=AUTH) as http:
        async def one(k: int) -> None:
            async with http.post(f"{base}/kiln/episodes") as resp:
                eid = (await resp.json())["episode_id"]
            messages: list[dict] = [{"role": "user", "content": PROMPT}]
            for turn in range(TURNS):
                t = time.perf_counter()
                async with http.post(f"{base}/chat/completions", json={
                        "model": "m", "messages": messages, "tools": TOOLS, "max_tokens": 40},
                        headers={"X-Kiln-Episode": eid}) as resp:
                    body = await resp.json()
                lat.append(time.perf_counter() - t)
                msg = body["choices"][0]["message"]
                messages.append({k: v for k, v in msg.items() if v is not None})
                if not msg.get("tool_calls"):
                    break
                messages += [{"role": "tool", "tool_call_id": c["id"],
                              "content": SCRIPT[min(turn, 1)][1]} for c in msg["tool_calls"]]
            async with http.post(f"{base}/kiln/episodes/{eid}/reward", json={"reward": 1.0}):
                pass

        t0, c0 = time.perf_counter(), time.process_time()
        await asyncio.gather(*[one(k) for k in range(episodes)])
    return summary("http endpoint (aiohttp client)", time.perf_counter() - t0, lat,
                   time.process_time() - c0)


async def via_http_process(base: str, episodes: int) -> dict:
    """`via_http` from a client process of its own (`--client`); the CPU per call is this
    process's, the endpoint's alone."""
    c0 = time.process_time()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, __file__, "--client", base, "--episodes", str(episodes),
        stdout=asyncio.subprocess.PIPE)
    out, _ = await proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"the client process exited with {proc.returncode}")
    row = json.loads(out.decode().strip().splitlines()[-1])
    row["path"] = "http endpoint (client process)"
    row["cpu_ms_per_call"] = round((time.process_time() - c0) / row["calls"] * 1000, 2)
    return row


async def via_openai(base: str, episodes: int, tag: str) -> dict:
    lat: list[float] = []
    limits = httpx.Limits(max_connections=episodes + 8, max_keepalive_connections=episodes + 8)
    async with AsyncOpenAI(base_url=base, api_key=KEY, max_retries=0,
                           http_client=httpx.AsyncClient(limits=limits, timeout=600)) as client, \
            httpx.AsyncClient(limits=limits, timeout=600, headers=AUTH) as http:
        async def one(k: int) -> None:
            eid = (await http.post(f"{base}/kiln/episodes")).json()["episode_id"]
            messages: list[dict] = [{"role": "user", "content": PROMPT}]
            for turn in range(TURNS):
                t = time.perf_counter()
                resp = await client.chat.completions.create(model="m", messages=messages, tools=TOOLS,
                                                            max_tokens=40,
                                                            extra_headers={"X-Kiln-Episode": eid})
                lat.append(time.perf_counter() - t)
                msg = resp.choices[0].message
                messages.append(msg.model_dump(exclude_none=True, exclude={"refusal", "annotations", "audio"}))
                if not msg.tool_calls:
                    break
                messages += [{"role": "tool", "tool_call_id": c.id, "content": SCRIPT[min(turn, 1)][1]}
                             for c in msg.tool_calls]
            await http.post(f"{base}/kiln/episodes/{eid}/reward", json={"reward": 1.0})

        t0, c0 = time.perf_counter(), time.process_time()
        await asyncio.gather(*[one(k) for k in range(episodes)])
    return summary("openai endpoint", time.perf_counter() - t0, lat, time.process_time() - c0)


async def main_async(args) -> list[dict]:
    tmp = Path(tempfile.mkdtemp())
    model = make_toolcall_model(tmp / "m")
    tok = AutoTokenizer.from_pretrained(str(model))
    fmt = make_format("hermes", tok)
    engine = await start_engine("vllm", EngineSettings(model=str(model), dtype="float32",
                                                       kv_cache_bytes=512 << 20))
    stored = []

    async def sink(trajs, size):
        stored.extend(trajs)

    server = OpenAIServer(ExternalEpisodes(engine, fmt, sink, max_tokens_per_turn=40,
                                           max_total_tokens=400), model_name="m", tokenizer=tok,
                          keys=ApiKeys({KEY: "bench"}))
    port = await server.start()
    base = f"http://127.0.0.1:{port}/v1"
    rows = []
    try:
        await baseline(engine, fmt, 8)  # warm-up
        for r in range(args.rounds):
            rows.append(await baseline(engine, fmt, args.episodes))
            rows.append(await via_http(base, args.episodes, f"h{r}"))
            rows.append(await via_http_process(base, args.episodes))
            if not args.skip_openai:
                rows.append(await via_openai(base, args.episodes, f"r{r}"))
        auth_us = await key_check_cost(base)
    finally:
        await server.stop()
        await engine.close()
    for row in rows:
        print(json.dumps(row))
    def mean(path: str, key: str) -> float | None:
        got = [r[key] for r in rows if r["path"] == path]
        return statistics.fmean(got) if got else None

    b = mean("baseline (agent loop)", "mean_ms")
    h = mean("http endpoint (aiohttp client)", "mean_ms")
    hp = mean("http endpoint (client process)", "mean_ms")
    o = mean("openai endpoint", "mean_ms")
    bc = mean("baseline (agent loop)", "cpu_ms_per_call")
    hc = mean("http endpoint (aiohttp client)", "cpu_ms_per_call")
    pc = mean("http endpoint (client process)", "cpu_ms_per_call")
    print(json.dumps({"episodes": args.episodes, "rounds": args.rounds,
                      "baseline_mean_ms": round(b, 1),
                      "http_mean_ms": round(h, 1), "http_overhead": round((h - b) / b, 3),
                      "process_client_mean_ms": round(hp, 1),
                      "process_client_overhead": round((hp - b) / b, 3),
                      "baseline_cpu_ms_per_call": round(bc, 2),
                      "http_cpu_ms_per_call": round(hc, 2),
                      "http_cpu_overhead_ms_per_call": round(hc - bc, 2),
                      "endpoint_cpu_overhead_ms_per_call": round(pc - bc, 2),
                      "load_average": [round(x, 2) for x in os.getloadavg()],
                      **({"openai_client_mean_ms": round(o, 1),
                          "openai_client_overhead": round((o - b) / b, 3)} if o else {}),
                      "trajectories": len(stored), "key_check_us_per_call": auth_us}))
    return rows


async def key_check_cost(base: str, n: int = 2000) -> float:
    """Mean extra microseconds of an authenticated call: GET /v1/models with the key against
    GET /healthz without one, interleaved, one at a time on one connection."""
    import aiohttp

    root = base.removesuffix("/v1")
    spent = {"models": 0.0, "healthz": 0.0}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as http:
        for i in range(n):
            for name, url, headers in (("models", f"{base}/models", AUTH),
                                       ("healthz", f"{root}/healthz", {})):
                t = time.perf_counter()
                async with http.get(url, headers=headers) as resp:
                    await resp.read()
                spent[name] += time.perf_counter() - t
    return round((spent["models"] - spent["healthz"]) / n * 1e6, 1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--episodes", type=int, default=128, help="concurrent episodes")
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds of every path")
    p.add_argument("--skip-openai", action="store_true",
                   help="leave out the openai client's path (its own cost dominates it)")
    p.add_argument("--client", metavar="URL", help=argparse.SUPPRESS)  # the client process
    args = p.parse_args()
    if args.client:
        print(json.dumps(asyncio.run(via_http(args.client, args.episodes, "client"))))
        return
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
