"""`spec.activeDeadlineSeconds` under `kiln run`: a cut-down quickstart whose RL stage could not
end in time stops at its deadline as on Ctrl-C, the services stopped in order (the trainer
checkpointing), and ends Failed: exit FAILED, `summary.json` saying DeadlineExceeded, the buffer's
files intact and the trainer's last step checkpointed. `ttlSecondsAfterFinished` is said to be
cluster-only."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from helpers.kiln_run import cut_down_job, read_records
from kiln.cli.exits import Exit

pytestmark = pytest.mark.slow

DEADLINE_S = 60  # past start-up and into training on an idle CI machine (103 steps in 120 s)


def test_a_run_past_its_deadline_ends_failed_and_keeps_what_it_did(tmp_path: Path) -> None:
    job, run = cut_down_job(tmp_path), tmp_path / "run"
    doc = yaml.safe_load(job.read_text())
    doc["spec"]["stages"][1]["maxSteps"] = 100_000  # never ends on its own
    doc["spec"]["activeDeadlineSeconds"] = DEADLINE_S
    doc["spec"]["ttlSecondsAfterFinished"] = 60
    job.write_text(yaml.safe_dump(doc, sort_keys=False))
    proc = subprocess.run([sys.executable, "-m", "kiln.cli.main", "run", str(job), "--run-dir", str(run)],
                          capture_output=True, text=True, cwd=tmp_path, timeout=DEADLINE_S + 600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == Exit.FAILED, out[-4000:]
    assert "spec.ttlSecondsAfterFinished (60s) applies on a cluster only" in out
    assert f"ran past spec.activeDeadlineSeconds ({DEADLINE_S}s)" in out
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["phase"], summary["reason"]) == ("Failed", "DeadlineExceeded")
    assert "kiln run --resume continues it" in summary["message"]
    # Nothing accepted lost: the buffer's files verify, and the trainer saved its last step.
    check = subprocess.run([sys.executable, "-m", "kiln.cli.main", "buffer", "check", str(run / "buffer")],
                           capture_output=True, text=True, timeout=120)
    assert check.returncode == 0, check.stdout + check.stderr
    steps = [r["trainer"].get("step", 0) for r in read_records(run) if r.get("event") == "progress"]
    if steps and max(steps):
        checkpoints = sorted((run / "trainer" / "checkpoints").glob("step_*"))
        assert checkpoints and int(checkpoints[-1].name.removeprefix("step_")) >= max(steps)
    print(json.dumps({"deadline_s": DEADLINE_S, "steps": summary.get("steps"),
                      "wall_s": summary.get("wall_seconds")}))
