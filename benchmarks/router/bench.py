"""The rollout fleet's router: does every multi-turn episode stay on one replica, and what does
the extra hop cost per call?

Two `kiln serve` replicas (vLLM, the tiny tool-calling model of tests/helpers/toolcall_model.py)
and the router in front of them (`python -m kiln.services.rollout.router_main`), each its own
process. A client process plays N 3-turn tool episodes, `--concurrency` at a time, half of
them opened with `POST /v1/kiln/episodes` and named in `X-Kiln-Episode` (a Kiln-aware
scaffold, rewarded at the end), half naming no episode (a stock client, found again by its
conversation; each with its own first message so that they spread over the replicas):

- routed: every call through the router;
- direct: the same episodes, each sent by the client itself to one replica (alternating), as
  a client with a fixed list of replicas would: the same load per replica without the hop.

Rounds alternate routed and direct in one run; each prints how many episodes each replica
served (a stock client's conversation is placed by its content, not by load, so a routed
round's split can be uneven). An episode counts as sticky when every one of
its calls was served by one replica (`X-Kiln-Replica`) and, for a stock client, continued the
same issued episode. Prints each round's p50/p99 call latency, then

    sticky: P% of N multi-turn episodes on one replica; routed/direct p50 latency R.RRx

    python benchmarks/router/bench.py [--episodes 64] [--concurrency 16] [--rounds 2]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))  # the tool-calling model the tests build

import httpx  # noqa: E402

from kiln.services.rollout.openai_server import REPLICA_HEADER  # noqa: E402
from helpers.toolcall_model import PROMPT, SCRIPT, TOOLS, make_toolcall_model  # noqa: E402

KEY = "bench-key-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {KEY}"}
TURNS = 3


def _start(cmd: list[str], ready: Path, log: Path, env: dict[str, str], timeout: float = 300) -> tuple[subprocess.Popen, int]:
    with open(log, "ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + timeout
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            sys.exit(f"{cmd[:4]} did not start:\n{log.read_text()[-2000:]}")
        time.sleep(0.2)
    return proc, json.loads(ready.read_text())["port"]


async def _episode(http: httpx.AsyncClient, base: str, i: int,
                   named: bool) -> tuple[list[float], bool, set[str]]:
    """One 3-turn episode; its call latencies, whether it stayed on one replica, and which."""
    headers = dict(AUTH)
    if named:
        r = await http.post(f"{base}/kiln/episodes", headers=AUTH)
        r.raise_for_status()
        headers["X-Kiln-Episode"] = r.json()["episode_id"]
    messages: list[dict] = [{"role": "user", "content": f"{PROMPT} ({i})"}]
    latencies, replicas, episodes = [], set(), set()
    for turn in range(TURNS):
        t0 = time.perf_counter()
        r = await http.post(f"{base}/chat/completions", headers=headers, json={
            "model": "model", "messages": messages, "tools": TOOLS, "temperature": 1.0})
        latencies.append(time.perf_counter() - t0)
        r.raise_for_status()
        body = r.json()
        replicas.add(r.headers[REPLICA_HEADER])
        episodes.add(body["kiln"]["episode_id"])
        msg = body["choices"][0]["message"]
        messages.append({k: v for k, v in msg.items() if v is not None})
        for call in msg.get("tool_calls") or []:
            messages.append({"role": "tool", "tool_call_id": call["id"],
                             "content": SCRIPT[min(turn, len(SCRIPT) - 1)][1]})
        if not msg.get("tool_calls"):
            messages.append({"role": "user", "content": "go on"})
    if named:
        r = await http.post(f"{base}/kiln/episodes/{headers['X-Kiln-Episode']}/reward",
                            headers=AUTH, json={"reward": 1.0, "group_size": 1})
        r.raise_for_status()
    return latencies, len(replicas) == 1 and len(episodes) == 1, replicas


async def _round(bases: list[str], episodes: int, concurrency: int) -> tuple[list[float], int, list[int]]:
    """Play `episodes` episodes (even ones named, odd ones not); episode i goes to
    bases[(i // 2) % len(bases)], so each replica gets both kinds."""
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=None)) as http:
        async def one(i: int):
            async with gate:
                return await _episode(http, bases[(i // 2) % len(bases)], i, named=i % 2 == 0)
        results = await asyncio.gather(*(one(i) for i in range(episodes)))
    per_replica: dict[str, int] = {}
    for _, _, replicas in results:
        for r in replicas:
            per_replica[r] = per_replica.get(r, 0) + 1
    return ([lat for lats, _, _ in results for lat in lats], sum(ok for _, ok, _ in results),
            sorted(per_replica.values(), reverse=True))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--episodes", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--rounds", type=int, default=2, help="routed and direct rounds each")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kiln-router-bench-"))
    model = make_toolcall_model(work / "model")
    keys = work / "keys"
    keys.write_text(KEY + "\n")
    env = {**os.environ, "KILN_OPENAI_API_KEYS": str(keys), "KILN_LOG_FORMAT": "text"}
    procs, ports = [], []
    try:
        for i in range(2):
            ready = work / f"serve-{i}.json"
            proc, port = _start([sys.executable, "-m", "kiln.cli.main", "serve", str(model),
                                 "--openai-port", "0", "--api-key-file", str(keys),
                                 "--max-tokens-per-turn", "40", "--ready-file", str(ready)],
                                ready, work / f"serve-{i}.log", env)
            procs.append(proc)
            ports.append(port)
        replicas = [f"http://127.0.0.1:{port}" for port in ports]
        proc, router_port = _start(
            [sys.executable, "-m", "kiln.services.rollout.router_main", "--port", "0",
             "--ready-file", str(work / "router.json"), *[a for u in replicas for a in ("--replica", u)]],
            work / "router.json", work / "router.log", env)
        procs.append(proc)
        time.sleep(2)  # the router's first health round
        routed, direct = [f"http://127.0.0.1:{router_port}/v1"], [u + "/v1" for u in replicas]
        asyncio.run(_round(direct, 8, 8))  # warm both engines
        lat = {"routed": [], "direct": []}
        sticky = total = 0
        for r in range(args.rounds):
            for name, bases in (("direct", direct), ("routed", routed)):
                t0 = time.perf_counter()
                lats, ok, spread = asyncio.run(_round(bases, args.episodes, args.concurrency))
                lat[name] += lats
                if name == "routed":
                    sticky, total = sticky + ok, total + args.episodes
                q = statistics.quantiles(lats, n=100)
                print(f"round {r + 1} {name:6s}: {len(lats)} calls in {time.perf_counter() - t0:.1f} s, "
                      f"p50 {1e3 * q[49]:.1f} ms, p99 {1e3 * q[98]:.1f} ms, episodes per replica "
                      f"{'/'.join(map(str, spread))}", flush=True)
        ratio = statistics.median(lat["routed"]) / statistics.median(lat["direct"])
        print(f"load average {os.getloadavg()[0]:.2f}")
        print(f"sticky: {100 * sticky / total:.0f}% of {total} multi-turn episodes on one replica; "
              f"routed/direct p50 latency {ratio:.2f}x")
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
