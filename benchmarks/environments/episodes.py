"""Episodes per minute and tool latency per environment, through a real sandbox service.

Starts `kiln-sandbox` (bubblewrap sandboxes) on the example task sets and plays each task's
scripted solution (`Environment.demonstrate`) as an episode over gRPC: open, one step per turn
(every tool call run in the episode's sandbox, whatever the solver knew), grading, close.
`--concurrency` episodes run at once, `--episodes` per environment in all.

Prints, per environment: episodes per minute, the latency of a step with tool calls (p50, p99:
gRPC + the tool in its sandbox), of the final step (grading), and of opening. The baseline in
the same run is a step of the same episode with no tool call (a reply the environment rejects),
which is everything but the tool: the service's own overhead per step.

    python benchmarks/environments/episodes.py [--episodes 64] [--concurrency 16]

Not covered: the model (see benchmarks/async_rl for rollout with vLLM).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import yaml

from kiln.api.validate import load_job
from kiln.episode import Action
from kiln.services.sandbox.client import GrpcEnvClient
from kiln.services.sandbox.episodes import load_task_set

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))  # the scripted solutions the tests play
from helpers.episodes import SCRIPTED  # noqa: E402
TASKS = REPO / "deploy" / "examples" / "tasks"
PLUGINS = REPO / "deploy" / "examples" / "plugins"
SETS = [("terminal", "terminal", "terminal.jsonl"), ("swe", "swe", "swe.jsonl"),
        ("search", "search", "search.jsonl"), ("code", "code", "code.jsonl"),
        ("echo", {"plugin": "echo_env:EchoFileEnv"}, "echo.jsonl"), ("lookup", "lookup", None)]


def job_file(tmp: Path) -> Path:
    tasks = []
    for name, env, file in SETS:
        source = {"path": str(TASKS / file)} if file else {"generate": {"count": 64, "seed": 1, "numSteps": 3}}
        tasks.append({"name": name, "env": env, **source})
    job = {"apiVersion": "kiln.dev/v1alpha1", "kind": "RLJob", "metadata": {"name": "bench-envs"},
           "spec": {"model": {"path": str(tmp / "no-model")}, "tasks": tasks,
                    "stages": [{"name": "rl", "type": "rl", "tasks": [s[0] for s in SETS],
                                "batchSize": 8, "microBatchSize": 8}],
                    "rollout": {"maxTurns": 8},
                    "sandbox": {"timeoutSeconds": 30, "maxConcurrent": 64}}}
    path = tmp / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))] * 1000 if s else float("nan")


async def play(env: GrpcEnvClient, task_set: str, index: int, turns, stats: dict) -> float:
    t0 = time.perf_counter()
    ep = await env.open(task_set, index, len(turns) + 2)
    stats["open"].append(time.perf_counter() - t0)
    reward = 0.0
    try:
        # The baseline: a step without a tool call that the environment does not end on.
        t = time.perf_counter()
        await env.step(ep.episode_id, Action(content="", unparseable=True, problem="benchmark"))
        stats["no_tool"].append(time.perf_counter() - t)
        for turn in turns:
            t = time.perf_counter()
            result = await env.step(ep.episode_id, Action(list(turn.tool_calls), turn.content))
            (stats["final"] if result.done else stats["tool"]).append(time.perf_counter() - t)
            if result.done:
                reward = result.reward
                break
    finally:
        await env.close(ep.episode_id)
    return reward


async def bench(address: str, job_path: Path, episodes: int, concurrency: int) -> list[dict]:
    job = load_job(job_path, local=True)
    rows = []
    async with grpc.aio.insecure_channel(address) as ch:
        env = GrpcEnvClient(ch, owner="bench")
        for _ in range(60):
            try:
                await env.task_sets()
                break
            except grpc.aio.AioRpcError:
                await asyncio.sleep(0.5)
        for spec in job.spec.tasks:
            loaded = load_task_set(spec, REPO)
            rng = random.Random(0)
            plans = []
            for i, task in enumerate(loaded.tasks):
                # The environment's own solver where it has one, else the example tasks'
                # scripted solutions that the episode tests play.
                turns = (loaded.environment.demonstrate(task, rng)
                         or SCRIPTED.get(getattr(task, "id", "")))
                if turns:
                    plans.append((i, turns))
            if not plans:
                continue
            stats: dict[str, list[float]] = {"open": [], "no_tool": [], "tool": [], "final": []}
            sem = asyncio.Semaphore(concurrency)

            async def one(k: int) -> float:
                index, turns = plans[k % len(plans)]
                async with sem:
                    return await play(env, spec.name, index, turns, stats)

            t0 = time.perf_counter()
            rewards = await asyncio.gather(*[one(k) for k in range(episodes)])
            wall = time.perf_counter() - t0
            rows.append({"env": spec.name, "episodes": episodes, "wall_s": round(wall, 2),
                         "episodes_per_min": round(episodes / wall * 60, 1),
                         "solved": sum(r >= 1.0 for r in rewards) / len(rewards),
                         "tool_p50_ms": round(pct(stats["tool"], 0.5), 1),
                         "tool_p99_ms": round(pct(stats["tool"], 0.99), 1),
                         "no_tool_p50_ms": round(pct(stats["no_tool"], 0.5), 1),
                         "final_p50_ms": round(pct(stats["final"], 0.5), 1),
                         "open_p50_ms": round(pct(stats["open"], 0.5), 1)})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--episodes", type=int, default=64, help="episodes per environment")
    p.add_argument("--concurrency", type=int, default=16, help="episodes in flight")
    p.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    args = p.parse_args()
    sys.path.insert(0, str(PLUGINS))  # the example plugin environment, as the service imports it
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        job = job_file(tmp)
        ports = tmp / "ports.json"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(PLUGINS), os.environ.get("PYTHONPATH", "")])}
        proc = subprocess.Popen(
            [sys.executable, "-m", "kiln.services.sandbox.main", "--job", str(job), "--address",
             "127.0.0.1:0", "--metrics-port", "0", "--port-file", str(ports), "--owner",
             f"bench-{os.getpid()}", "--insecure"],  # environment cost alone, not TLS's
            cwd=tmp, env=env, stdout=subprocess.DEVNULL,
            stderr=(tmp / "sandbox.log").open("w"))
        try:
            deadline = time.monotonic() + 120
            while not ports.exists():
                if proc.poll() is not None or time.monotonic() > deadline:
                    sys.exit(f"sandbox service did not start:\n{(tmp / 'sandbox.log').read_text()}")
                time.sleep(0.1)
            address = f"127.0.0.1:{json.loads(ports.read_text())['port']}"
            rows = asyncio.run(bench(address, job, args.episodes, args.concurrency))
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
