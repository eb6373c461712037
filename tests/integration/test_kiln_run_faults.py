"""The fault suite on `kiln run`: during the RL stage of a cut-down quickstart, SIGKILL the
weight-sync, sandbox, rollout and trainer services one after another. The launcher restarts
each; the job must still finish with every stage's steps, nothing the buffer acknowledged lost,
the buffer's files intact, and the trainer and weight-sync agreeing on the final version."""
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

from helpers.kiln_run import cut_down_job, read_records

pytestmark = pytest.mark.slow

# Service -> the RL step at which it is killed (one at a time, each after the previous restart).
FAULTS = [("weight_sync", 1), ("sandbox", 2), ("rollout", 3), ("trainer", 4)]


def test_every_service_killed_mid_run_and_the_job_finishes(tmp_path: Path) -> None:
    job, run = cut_down_job(tmp_path), tmp_path / "run"
    # Steps to spare after the last fault, so that the stage is still running when it comes.
    doc = yaml.safe_load(job.read_text())
    doc["spec"]["stages"][1]["maxSteps"] = 10
    job.write_text(yaml.safe_dump(doc, sort_keys=False))
    proc = subprocess.Popen([sys.executable, "-m", "kiln.cli.main", "run", str(job), "--run-dir", str(run)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path)
    killed: list[tuple[str, float]] = []
    try:
        deadline = time.monotonic() + 1500
        pending = list(FAULTS)
        while proc.poll() is None and time.monotonic() < deadline:
            if pending:
                service, step = pending[0]
                rl_step = max((r.get("step", 0) for r in read_records(run) if r.get("stage") == "rl"), default=-1)
                # One fault at a time: the previous one's restart is on record first.
                restarted = all(any(r.get("event") == "restart" and s in r.get("services", [])
                                    for r in read_records(run)) for s, _ in killed)
                if rl_step >= step and restarted:
                    pid = json.loads((run / service / "ports.json").read_text())["pid"]
                    os.kill(pid, signal.SIGKILL)
                    killed.append((service, time.time()))
                    pending.pop(0)
            time.sleep(0.5)
        out = proc.communicate(timeout=120)[0] if proc.poll() is not None else ""
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.wait(120)
    assert [s for s, _ in killed] == [s for s, _ in FAULTS], out[-3000:]
    assert proc.returncode == 0, out[-4000:]
    for service, _ in FAULTS:
        assert f"{service} exited with code -9; restarting" in out
    summary = json.loads((run / "summary.json").read_text())
    assert summary["heldout_success_after_rl"] is not None
    records = read_records(run)
    progress = [r for r in records if r.get("event") == "progress"]
    for r in progress:
        assert r["buffer"]["accepted"] >= r["rollout"]["shipped"], r
    check = subprocess.run([sys.executable, "-m", "kiln.cli", "buffer", "check", str(run / "buffer")],
                           capture_output=True, text=True, timeout=120)
    assert check.returncode == 0, check.stderr
    # One version after SFT and one per RL step at least (the trainer's restart adds one).
    assert summary["final_policy_version"] >= 11
    # The figures docs/results/faults.md quotes (run with -s to see them).
    restarts = [r for r in records if r.get("event") == "restart"]
    print(json.dumps({"faults": [s for s, _ in killed], "restart_events": len(restarts),
                      "accepted": progress[-1]["buffer"]["accepted"],
                      "shipped": progress[-1]["rollout"]["shipped"],
                      "recovery_s": {s: round(next(r["time"] for r in records if r.get("event") == "restart"
                                                  and s in r.get("services", [])) - t, 1)
                                     for s, t in killed},
                      "final_policy_version": summary["final_policy_version"],
                      "wall_s": summary["wall_seconds"]}))
