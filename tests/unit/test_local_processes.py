"""`kiln run`'s process handling: what a dead service leaves in its session is killed."""
from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from kiln.cli.local.processes import ServiceProcess, kill_leftovers


def _children(pid: int) -> list[int]:
    """Processes whose parent is `pid` (from /proc)."""
    out = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                if entry.isdigit() and int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(entry))
        except (OSError, ValueError, IndexError):
            pass  # gone meanwhile, or not a process
    return out


def test_a_killed_service_leaves_nothing_behind(tmp_path: Path) -> None:
    """A service killed with SIGKILL leaves its children (vLLM's engine core) running in its
    session; `kill_leftovers`, which the launcher calls before a restart and after a stop,
    ends them."""
    proc = subprocess.Popen(["sh", "-c", "sleep 300 & sleep 300"], start_new_session=True)
    svc = ServiceProcess("rollout", proc, tmp_path, tmp_path / "log")
    deadline = time.monotonic() + 60
    while not _children(proc.pid):  # the background sleep started, however loaded the machine
        assert time.monotonic() < deadline, "the service's children never started"
        time.sleep(0.02)
    proc.kill()
    proc.wait()
    os.killpg(proc.pid, 0)  # the child is still there, in the dead leader's group
    kill_leftovers(svc)
    deadline = time.monotonic() + 60
    while True:
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        assert time.monotonic() < deadline, "the child survived"
        time.sleep(0.05)
    kill_leftovers(svc)  # nothing left: a no-op


def test_each_run_directory_has_its_own_sandbox_owner(tmp_path: Path) -> None:
    """The sandbox service reaps its owner's sandboxes at start: two runs on one machine must
    not share one (the second would remove the first's live sandboxes), while a resumed run
    keeps its own, to reap what its killed predecessor left."""
    from kiln.cli.local.processes import sandbox_owner
    from kiln.services.sandbox.main import _owner

    a, b = sandbox_owner(tmp_path / "a"), sandbox_owner(tmp_path / "b")
    assert a != b and sandbox_owner(tmp_path / "a") == a
    assert sandbox_owner(tmp_path / "x" / ".." / "a") == a
    # The service takes it as given (its names allow nothing else).
    assert _owner(type("Args", (), {"owner": a})) == a


def test_reaping_a_sandbox_that_its_owner_removes_meanwhile(tmp_path: Path) -> None:
    from kiln.services.sandbox.factory import remove_tree

    tree = tmp_path / "kiln-sbx-x-ep-1"
    (tree / "workspace" / "d").mkdir(parents=True)
    (tree / "workspace" / "d" / "f").write_text("1")
    remove_tree(tree)
    assert not tree.exists()
    remove_tree(tree)  # already gone: nothing to do, no error
    (tmp_path / "file").write_text("1")
    with pytest.raises(NotADirectoryError):
        remove_tree(tmp_path / "file")
