"""`kiln run` end to end: every service a real process, the real engines, a cut-down job.

Mid-way through the RL stage the buffer is killed with SIGKILL; the launcher restarts it on the
same port and run directory. Afterwards the run's records must show:
- every trained trajectory's staleness within tau (the buffer serves nothing staler);
- version spans of every kept trajectory monotonic and covering every generated token;
- loss masks that exclude the prompt and every observation;
- nothing the buffer acknowledged lost across the kill (its accepted count, recovered from its
  log, never falls behind what rollout saw acknowledged);
- a summary with held-out success before and after RL.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from kiln.trajectory import Trajectory, VersionSpan

REPO = Path(__file__).resolve().parents[2]
TAU = 1

pytestmark = pytest.mark.slow


def _job(tmp: Path) -> Path:
    job = yaml.safe_load((REPO / "deploy" / "examples" / "quickstart.yaml").read_text())
    spec = job["spec"]
    job["metadata"]["name"] = "e2e"
    spec["model"]["path"] = str(tmp / "model")
    spec["model"]["init"].update(hiddenSize=64, numLayers=1, numHeads=2, numKvHeads=1,
                                 intermediateSize=128)
    spec["tasks"][0]["generate"]["count"] = 300
    spec["tasks"][1]["generate"]["count"] = 8
    sft, rl = spec["stages"]
    sft.update(maxSteps=8, batchSize=16, microBatchSize=16, warmupSteps=0)
    rl.update(maxSteps=6, batchSize=16, microBatchSize=16)
    rl["rl"].update(groupSize=4, tau=TAU)
    spec["rollout"].update(maxConcurrentEpisodes=32)
    spec["sandbox"]["maxConcurrent"] = 32
    path = tmp / "job.yaml"
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return path


def _records(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_kiln_run_end_to_end_with_a_buffer_kill(tmp_path):
    job, run = _job(tmp_path), tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "kiln.services.cli", "run", str(job), "--run-dir", str(run)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path)
    killed = False
    try:
        deadline = time.monotonic() + 900
        while proc.poll() is None and time.monotonic() < deadline:
            if not killed and any(r.get("stage") == "rl" and r.get("step", 0) >= 2 for r in _records(run)):
                pid = json.loads((run / "buffer" / "ports.json").read_text())["pid"]
                os.kill(pid, signal.SIGKILL)
                killed = True
            time.sleep(0.5)
        out = proc.communicate(timeout=60)[0] if proc.poll() is not None else ""
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.wait(120)
    assert killed, "the RL stage never reached step 2"
    assert proc.returncode == 0, out[-4000:]
    assert "buffer exited with code -9; restarting" in out

    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 8 + 6
    assert summary["final_policy_version"] >= 7  # one after SFT, one per RL step (syncInterval 1)
    assert 0 <= summary["heldout_success_before_rl"] <= 1
    assert 0 <= summary["heldout_success_after_rl"] <= 1
    assert summary["max_staleness"] <= TAU

    records = _records(run)
    assert any(r.get("event") == "restart" and r["services"] == ["buffer"] for r in records)
    progress = [r for r in records if r.get("event") == "progress"]
    # Rollout's status is read before the buffer's in each poll: the buffer must always have
    # accepted at least what rollout saw acknowledged, before and after the kill.
    assert progress
    for r in progress:
        assert r["buffer"]["accepted"] >= r["rollout"]["shipped"], r
        assert r["buffer"]["max_staleness"] <= TAU

    rows = [json.loads(line) for line in (run / "rollout" / "trajectories.jsonl").read_text().splitlines()]
    assert {r["stage"] for r in rows} == {"sft", "rl"}
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tmp_path / "model"))
    obs_open, obs_close = tok.convert_tokens_to_ids("<obs>"), tok.convert_tokens_to_ids("</obs>")
    for row in rows:
        row.pop("stage")
        row["version_spans"] = [VersionSpan(**s) for s in row["version_spans"]]
        t = Trajectory(**row)
        t.check()  # spans in order, non-decreasing, covering every generated token
        assert not any(t.loss_mask[: t.prompt_len])
        inside = False
        for token, mask in zip(t.tokens, t.loss_mask):
            if token == obs_open:
                inside = True
            if inside or token in (obs_open, obs_close):
                assert mask == 0, "an observation token is trained on"
            if token == obs_close:
                inside = False
        versions = [v for v in t.versions_per_token() if v >= 0]
        assert versions == sorted(versions)
