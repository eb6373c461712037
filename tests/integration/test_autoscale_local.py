"""Rollout autoscaling in `kiln run`: real worker processes, each with its own vLLM engine.

The RL stage is asynchronous with slow tools (`toolLatency`), so the trainer waits for batches
and autoscaling starts a second rollout worker; that worker takes work only at the trainer's
current policy version, and once the staleness trained reaches tau - stalenessMargin the
worker is drained and stopped again. Nothing is trained beyond tau throughout.
"""
from __future__ import annotations

import json

import pytest
import yaml

from helpers.kiln_run import cut_down_job, kiln_run, read_records

pytestmark = pytest.mark.slow
TAU = 3


def test_rollout_scales_up_while_the_trainer_waits_and_down_near_tau(tmp_path):
    job = cut_down_job(tmp_path)
    doc = yaml.safe_load(job.read_text())
    spec = doc["spec"]
    spec["trainer"]["dataParallel"] = 1
    # A narrow latency spread: with one worker, groups rarely finish out of order, so staleness
    # near tau (which holds the count at one) comes from the second worker.
    spec["tasks"][0]["toolLatency"] = {"p50Seconds": 0.3, "p99Seconds": 0.6}
    # Two groups in flight per worker against batches of four: one worker leaves the trainer
    # waiting, two fill the buffer and age what it holds.
    spec["rollout"].update(sampleEvery=1, maxConcurrentEpisodes=8, autoscale={
        "minReplicas": 1, "maxReplicas": 2, "windowSteps": 2, "scaleUpIdle": 0.2,
        "stalenessMargin": 1})
    sft, rl = spec["stages"]
    sft["maxSteps"] = 4
    # Steps enough for an up and a down under load: the second worker takes ~20-40 s to start,
    # and a backlog left in the buffer can run the trainer through the first dozens of steps
    # before it ever waits.
    rl.update(maxSteps=100)
    rl["rl"].update(tau=TAU)
    rl.pop("eval", None)
    job.write_text(yaml.safe_dump(doc, sort_keys=False))
    run = tmp_path / "run"
    out = kiln_run(job, run)
    scales = [r for r in read_records(run) if r.get("event") == "scale"]
    assert scales, out[-3000:]
    assert (scales[0]["from"], scales[0]["to"]) == (1, 2) and "trainer idle" in scales[0]["reason"]
    assert "rollout: worker rollout-1 joined" in out
    downs = [s for s in scales if s["to"] < s["from"]]
    # (A backlog in the buffer may shrink it too; staleness near tau must, at least once.)
    assert any("near tau" in s["reason"] for s in downs), scales
    assert "rollout: worker rollout-1 stopped" in out
    # The second worker's episodes started at a version the trainer had published after the
    # stage began, never on the weights the worker's engine was started with.
    joined = [json.loads(line) for line in
              (run / "rollout-1" / "trajectories.jsonl").read_text().splitlines()]
    assert joined, "the second worker shipped nothing"
    first_scale_step = scales[0]["step"]
    for t in joined:
        assert t["stage"] == "rl"
        assert min(s["policy_version"] for s in t["version_spans"]) >= first_scale_step
    summary = json.loads((run / "summary.json").read_text())
    assert 0 <= summary["max_staleness"] <= TAU
