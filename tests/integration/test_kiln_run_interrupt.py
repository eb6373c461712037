"""Ctrl-C in the middle of `kiln run` (the cut-down quickstart): the run stops with 130 and
still leaves `report/` with the loss plot, the progress it printed showed the SFT loss, the
end table sums up the stages, and `kiln report RUN_DIR` draws the report again. The services'
logs (JSON, the default) are JSON lines throughout, rollout's too, where vLLM's C++ side,
progress bars and bare prints write below Python's logging."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from helpers.kiln_run import cut_down_job, read_records

pytestmark = pytest.mark.slow


def test_interrupted_run_leaves_its_report(tmp_path: Path) -> None:
    job, run = cut_down_job(tmp_path), tmp_path / "run"
    doc = yaml.safe_load(job.read_text())
    doc["spec"]["trainer"]["dataParallel"] = 1
    doc["spec"]["stages"][1]["maxSteps"] = 50  # still running when it is interrupted
    job.write_text(yaml.safe_dump(doc, sort_keys=False))
    proc = subprocess.Popen([sys.executable, "-m", "kiln.cli.main", "run", str(job), "--run-dir", str(run)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 900
        while proc.poll() is None and time.monotonic() < deadline:
            if any(r.get("stage") == "rl" and r.get("step", 0) >= 1 for r in read_records(run)):
                proc.send_signal(signal.SIGINT)
                break
            time.sleep(0.5)
        out = proc.communicate(timeout=300)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(60)
    assert proc.returncode == 130, out[-4000:]
    sft_lines = [line for line in out.splitlines() if line.startswith("[sft] step")]
    assert sft_lines and all("loss" in line and "lr" in line for line in sft_lines), out[-4000:]
    assert any(line.split()[:3] == ["sft", "sft", "8/8"] for line in out.splitlines()), out[-3000:]
    for name in ("loss.png", "reward.png", "staleness.png"):
        assert (run / "report" / name).stat().st_size > 1000, out[-3000:]

    for service in ("trainer", "buffer", "weight_sync", "sandbox", "rollout"):
        lines = (run / "logs" / f"{service}.log").read_text().splitlines()
        plain = [line for line in lines if not _is_json(line)]
        assert lines and not plain, (service, plain[:10])

    (run / "report" / "loss.png").unlink()
    again = subprocess.run([sys.executable, "-m", "kiln.cli.main", "report", str(run)],
                           capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr
    assert (run / "report" / "loss.png").stat().st_size > 1000


def _is_json(line: str) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except json.JSONDecodeError:
        return False
