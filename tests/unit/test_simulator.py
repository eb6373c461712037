"""The RL-stage simulator (`kiln simulate`): closed-form cases it must reproduce, freshness
invariants under random settings, and the command on a job file."""
from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kiln.cli.simulation import EngineModel, JobModel, Workload, zipf_calls
from kiln.cli.simulator import simulate

REPO = Path(__file__).resolve().parents[2]


def fixed(calls: int):
    return lambda rng: calls


def test_a_synchronous_step_is_generation_then_training_then_the_weight_load():
    """One generation of 20 tokens per episode, 16 episodes decoding together: each step is
    20 decode steps of (a + 16 b), then the optimizer step; every batch after the first also
    waits for the replica to load the new version."""
    a, b, train, pause = 0.01, 0.001, 2.0, 0.5
    w = Workload(fixed(0), gen_tokens=20, prompt_tokens=0, obs_tokens=0)
    e = EngineModel(a, b, prefill_cost=0.0)
    r = simulate(w, e, JobModel(batch=16, group=4, tau=None, asynchronous=False, train_step=train,
                                sync_pause=pause, max_concurrent=64, steps=5))
    gen = 20 * (a + 16 * b)
    assert r.seconds == pytest.approx(5 * (gen + train) + 4 * pause, rel=1e-6)
    assert r.trained == 80 and r.staleness == {0: 80}
    assert r.trainer_idle == pytest.approx(5 * gen / r.seconds + 4 * pause / r.seconds, rel=1e-6)


def test_tools_take_their_latency_outside_the_engine():
    """Two calls of exactly 1 s each: three generations plus 2 s per episode, and the engine
    idles while every episode waits on its tool."""
    a, b = 0.01, 0.0
    w = Workload(fixed(2), gen_tokens=10, prompt_tokens=0, obs_tokens=0, tool_p50=1.0, tool_p99=1.0)
    e = EngineModel(a, b, prefill_cost=0.0)
    r = simulate(w, e, JobModel(batch=8, group=8, tau=None, asynchronous=False, train_step=0.0,
                                sync_pause=0.0, max_concurrent=8, steps=1))
    assert r.seconds == pytest.approx(3 * 10 * a + 2.0, rel=1e-6)
    assert r.engine_idle == pytest.approx(2.0 / r.seconds, rel=1e-6)


def test_async_never_trains_beyond_tau_and_beats_sync_on_long_tailed_tools():
    rng = random.Random(5)
    for _ in range(6):
        tau = rng.choice([1, 2, 4])
        w = Workload(zipf_calls(2, 1.0), tool_p50=rng.choice([0.2, 1.0]), tool_p99=20.0,
                     tool_max=60.0)
        e = EngineModel(0.01, 0.0005)
        job = dict(batch=32, group=4, tau=tau, train_step=rng.choice([0.2, 1.0]),
                   max_concurrent=256, target_occupancy=16, steps=8)
        sync = simulate(w, e, JobModel(asynchronous=False, **job), seed=1)
        asyn = simulate(w, e, JobModel(asynchronous=True, **job), seed=1)
        assert asyn.max_staleness <= tau and sync.max_staleness == 0
        assert asyn.trajectories_per_minute > sync.trajectories_per_minute


def test_a_small_tau_stops_episodes_early_instead_of_finishing_them():
    w = Workload(fixed(6), tool_p50=1.0, tool_p99=1.0)
    e = EngineModel(0.01, 0.0005)
    r = simulate(w, e, JobModel(batch=8, group=4, tau=1, asynchronous=True, train_step=0.1,
                                max_concurrent=64, steps=6))
    assert r.stopped_stale > 0 and r.max_staleness <= 1


def _agentic_job(tmp_path: Path) -> Path:
    """The quickstart's RL stage with long-tailed tasks and tools, as the async benchmark runs."""
    job = yaml.safe_load((REPO / "deploy" / "examples" / "quickstart.yaml").read_text())
    spec = job["spec"]
    spec["tasks"][0]["generate"] = {"count": 100, "numSteps": 2, "lengthTail": 1.0}
    spec["tasks"][0]["toolLatency"] = {"p50Seconds": 1, "p99Seconds": 30, "maxSeconds": 120}
    spec["stages"] = [s for s in spec["stages"] if s["type"] == "rl"]
    spec["stages"][0]["rl"]["tau"] = 4
    spec["stages"][0].pop("eval", None)
    spec["rollout"].update(maxConcurrentEpisodes=512, targetEngineOccupancy=32)
    path = tmp_path / "agentic.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def test_kiln_simulate_prints_both_modes_for_a_job(tmp_path: Path):
    job = _agentic_job(tmp_path)
    out = subprocess.run([sys.executable, "-m", "kiln.cli.main", "simulate", str(job),
                          "--steps", "3", "--seeds", "1"], capture_output=True, text=True,
                         check=True, timeout=120).stdout
    assert "trajectories trained / min" in out
    last = out.strip().splitlines()[-1]
    assert last.startswith("async/sync: ") and "tau 4" in last


def test_kiln_simulate_plans_a_large_job(tmp_path: Path):
    job = _agentic_job(tmp_path)
    out = subprocess.run([sys.executable, "-m", "kiln.cli.main", "simulate", str(job),
                          "--steps", "3", "--seeds", "1", "--accelerators", "64",
                          "--replica-accelerators", "2", "--train-seconds-per-trajectory", "0.5",
                          "--taus", "2,4", "--sim-replicas", "4"],
                         capture_output=True, text=True, check=True, timeout=300).stdout
    assert "best within max staleness 8:" in out
