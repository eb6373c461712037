"""Two podman services on one storage root (two test runs, or `kiln run` beside a test run):
neither may take the other's socket away."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from kiln.services.sandbox.podman_service import PodmanService

pytestmark = pytest.mark.skipif(
    not (shutil.which("podman") and shutil.which("runc")),
    reason="podman and runc are not installed (deploy/setup.sh installs them)")


@pytest.fixture
def root():
    """A root of its own; short, because podman refuses a run root longer than 50 characters."""
    path = Path(tempfile.mkdtemp(prefix="kiln-pt-", dir="/var/tmp"))
    yield path
    subprocess.run(["podman", "--root", str(path / "storage"), "--runroot", str(path / "run"),
                    "system", "reset", "--force"], capture_output=True)
    shutil.rmtree(path, ignore_errors=True)


def test_services_on_one_root_keep_their_own_sockets(root):
    with PodmanService(root) as first:
        with PodmanService(root) as second:
            assert first._ping() and second._ping(), "a second service took the first's socket"
        assert first._ping(), "stopping the second service stopped or unlinked the first"
    assert not any(root.glob("api-*")), "a stopped service left its socket or configuration"


def test_a_dead_services_socket_is_removed_at_the_next_start(root):
    # A process that has exited: its pid names sockets nobody serves any more.
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    stale = root / f"api-{dead}-deadbeef.sock"
    stale.touch()
    live = root / f"api-{os.getppid()}-cafecafe.sock"  # a live process's: kept
    live.touch()
    with PodmanService(root):
        assert not stale.exists()
        assert live.exists()
