"""The runtime side of the capability table: each service that a capability protects, started
as its pod would start it on a job that fails it, exits at start-up with code 2 and the same
message `kiln validate` gives (no traceback, nothing else started)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kiln.api.capabilities import CAPABILITIES
from kiln.api.validate import validate_text
from helpers.capabilities import violating_job

pytestmark = pytest.mark.slow

CASES = [(c, component) for c in CAPABILITIES for component in c.enforced_by
         if component in ("trainer", "rollout")]


@pytest.mark.parametrize(("cap", "component"), CASES, ids=[f"{c.name}-{s}" for c, s in CASES])
def test_the_service_refuses_at_start_up(tmp_path: Path, cap, component: str) -> None:
    doc, _ = violating_job(tmp_path, cap.name)
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(doc, sort_keys=False))
    (expected,) = validate_text(job.read_text(), file=str(job), local=True)[1]
    message = expected.message.split(": ", 1)[1] if cap.needs_model else expected.message
    proc = subprocess.run(
        [sys.executable, "-m", f"kiln.services.{component}.main", "--job", str(job),
         "--run-dir", str(tmp_path / "run"), "--address", "127.0.0.1:0", "--metrics-port", "0"],
        capture_output=True, text=True, timeout=180)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert message in proc.stderr and cap.path in proc.stderr, proc.stderr[-2000:]
