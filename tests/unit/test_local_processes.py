"""`kiln run`'s process handling: what a dead service leaves in its session is killed."""
from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

from kiln.cli.local.processes import ServiceProcess, kill_leftovers


def test_a_killed_service_leaves_nothing_behind(tmp_path: Path) -> None:
    """A service killed with SIGKILL leaves its children (vLLM's engine core) running in its
    session; `kill_leftovers`, which the launcher calls before a restart and after a stop,
    ends them."""
    proc = subprocess.Popen(["sh", "-c", "sleep 300 & sleep 300"], start_new_session=True)
    svc = ServiceProcess("rollout", proc, tmp_path, tmp_path / "log")
    time.sleep(0.3)
    proc.kill()
    proc.wait()
    os.killpg(proc.pid, 0)  # the child is still there, in the dead leader's group
    kill_leftovers(svc)
    deadline = time.monotonic() + 5
    while True:
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        assert time.monotonic() < deadline, "the child survived"
        time.sleep(0.05)
    kill_leftovers(svc)  # nothing left: a no-op
