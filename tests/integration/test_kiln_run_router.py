"""`kiln run` with two rollout workers behind the router, trained on outside episodes alone.

The RL stage has no task sets of its own (`tasks: []`): every trajectory it trains on comes
from a scaffold playing episodes through the OpenAI endpoint (`rollout.openaiPort`, which the
router holds). Sixteen 3-turn episodes run at once and each is served by the worker that
opened it; then one worker is killed mid-episode: its open episodes get a retryable 503
naming it, they are played again on new episodes, which go to the live worker, and every
rewarded trajectory is trained on (acknowledged in the buffer's log).
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml
from openai import AsyncOpenAI

from kiln.services.buffer import records
from kiln.services.rollout.openai_server import REPLICA_HEADER

pytestmark = pytest.mark.slow
GROUP = 4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _job(tmp: Path, port: int) -> Path:
    doc = {"apiVersion": "kiln.dev/v1alpha1", "kind": "RLJob", "metadata": {"name": "routed"},
           "spec": {
               "model": {"path": str(tmp / "model"), "dtype": "float32", "init": {
                   "arch": "qwen2", "hiddenSize": 64, "numLayers": 1, "numHeads": 2,
                   "numKvHeads": 1, "intermediateSize": 128, "vocabSize": 320,
                   "maxPositionEmbeddings": 512}},
               # For the tokenizer the model is made with; no stage plays it.
               "tasks": [{"name": "chains", "env": "chain", "generate": {"count": 50}}],
               "stages": [{"name": "outside", "type": "rl", "tasks": [], "maxSteps": 3,
                           "learningRate": 1e-4, "batchSize": 2 * GROUP,
                           "microBatchSize": 2 * GROUP, "rl": {"groupSize": GROUP, "tau": 8}}],
               "rollout": {"replicas": 2, "openaiPort": port, "toolCallFormat": "hermes",
                           "maxConcurrentEpisodes": 8, "kvCacheBytes": 64 << 20,
                           "sampling": {"maxTokensPerTurn": 8, "maxTotalTokens": 400}},
               "sandbox": {"maxConcurrent": 4}}}
    path = tmp / "job.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


class Scaffold:
    def __init__(self, base: str, key: str) -> None:
        self.base, self.auth = base, {"Authorization": f"Bearer {key}"}
        self.http = httpx.AsyncClient(timeout=120)
        self.client = AsyncOpenAI(base_url=base, api_key=key, max_retries=0, timeout=120)

    async def open(self) -> tuple[str, str]:
        r = await self.http.post(f"{self.base}/kiln/episodes", headers=self.auth)
        assert r.status_code == 201, r.text
        return r.json()["episode_id"], r.headers[REPLICA_HEADER]

    async def turn(self, episode: str, messages: list[dict]) -> httpx.Response:
        r = await self.http.post(f"{self.base}/chat/completions", headers={
            **self.auth, "X-Kiln-Episode": episode}, json={"model": "model", "messages": messages})
        if r.status_code == 200:
            messages += [r.json()["choices"][0]["message"], {"role": "user", "content": "go on"}]
        return r

    async def play(self, episode: str, turns: int = 3, messages: list | None = None) -> list[str]:
        """The replica of each call."""
        messages = messages if messages is not None else [{"role": "user", "content": "start"}]
        served = []
        for _ in range(turns):
            r = await self.turn(episode, messages)
            assert r.status_code == 200, r.text
            served.append(r.headers[REPLICA_HEADER])
        return served

    async def reward(self, episode: str, group: str) -> list[str]:
        r = await self.http.post(f"{self.base}/kiln/episodes/{episode}/reward", headers=self.auth,
                                 json={"reward": 1.0, "group_id": group, "group_size": GROUP})
        assert r.status_code == 200, r.text
        return r.json()["trajectories"]


def _wait_for_fleet(base: str, proc: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "kiln run exited before its workers served"
        try:
            health = httpx.get(base.removesuffix("/v1") + "/healthz", timeout=2).json()
            if sum(r["state"] == "serving" for r in health["replicas"]) == 2:
                return
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        time.sleep(1)
    raise AssertionError("two rollout workers never served behind the router")


def _worker_pid(run: Path, worker: str) -> int:
    out = subprocess.run(["pgrep", "-f", "--", f"--run-dir {run / worker} "], capture_output=True,
                         text=True).stdout.split()
    assert len(out) == 1, out
    return int(out[0])


async def _drive(base: str, key: str, run: Path) -> dict:
    s = Scaffold(base, key)
    # Sixteen 3-turn episodes at once, opened by load: eight per worker.
    opened = [await s.open() for _ in range(16)]
    served = await asyncio.gather(*(s.play(ep) for ep, _ in opened))
    trained = [t for i, (ep, _) in enumerate(opened) for t in await s.reward(ep, f"g{i // GROUP}")]
    # Two more groups, one turn each; then a worker dies under half of them.
    second = [await s.open() for _ in range(2 * GROUP)]
    histories = {ep: [{"role": "user", "content": "start"}] for ep, _ in second}
    for ep, _ in second:
        await s.turn(ep, histories[ep])
    victim = second[0][1]
    worker = "rollout" if victim.startswith("rollout-0-") else "rollout-1"
    os.kill(_worker_pid(run, worker), signal.SIGKILL)
    lost, replays = [], []
    for i, (ep, inst) in enumerate(second):
        r = await s.turn(ep, histories[ep])
        if inst == victim:
            lost.append(r)
            ep, inst = await s.open()  # played again from the start, on a new episode
            replays.append(inst)
            await s.play(ep, turns=3)
        else:
            assert r.status_code == 200, r.text
            await s.play(ep, turns=1, messages=histories[ep])
        trained += await s.reward(ep, f"g-after-{i // GROUP}")
    await s.http.aclose()
    await s.client.close()
    return {"opened": opened, "served": served, "lost": lost, "victim": victim,
            "replays": replays, "trained": trained}


def test_kiln_run_routes_episodes_to_their_worker_and_survives_losing_one(tmp_path: Path) -> None:
    port = _free_port()
    job, run = _job(tmp_path, port), tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "kiln.cli.main", "run", str(job), "--run-dir",
                             str(run)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, cwd=tmp_path)
    base = f"http://127.0.0.1:{port}/v1"
    try:
        _wait_for_fleet(base, proc)
        key = (run / "openai" / "api-key").read_text().strip()
        got = asyncio.run(_drive(base, key, run))
        out = proc.communicate(timeout=600)[0]
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.wait(120)
    assert proc.returncode == 0, out[-4000:]
    workers = {inst for _, inst in got["opened"]}
    assert len(workers) == 2 and sorted(inst for _, inst in got["opened"]).count(min(workers)) == 8
    for (episode, inst), served in zip(got["opened"], got["served"]):
        assert served == [inst] * 3 and episode.endswith("." + inst)
    assert got["lost"], "no episode was open on the killed worker"
    for r in got["lost"]:
        assert r.status_code == 503 and r.json()["error"]["code"] == "replica_gone"
        assert got["victim"] in r.json()["error"]["message"]
    assert got["replays"] and got["victim"] not in got["replays"]
    assert "rollout-1 exited" in out or "rollout exited" in out
    # Every rewarded trajectory was trained on: acknowledged in a batch, none dropped.
    log = records.read_records(run / "buffer" / "buffer" / "side.log")
    events = [json.loads(payload) for _, _, payload in log.records]
    acked = {t for e in events if e.get("t") == "acked" for t in e["consumed"]}
    assert len(got["trained"]) == 24 and set(got["trained"]) <= acked
