"""The keepalive test's two idle gRPC connections (`tests/integration/test_keepalive.py`): each
holds one connection idle for 80 s at gRPC's real ping cadence, a server with Kiln's options and
one with gRPC's defaults. They only sleep, so the suite starts them once it knows the test is
selected (`tests/conftest.py`) and the test reads their result when its turn comes, instead of
adding 80 s of waiting to a serial run."""
from __future__ import annotations

import subprocess
import sys

IDLE = """
import sys, time
from concurrent import futures
import grpc
from kiln.control.channels import CHANNEL_OPTIONS

server = grpc.server(futures.ThreadPoolExecutor(2), options=CHANNEL_OPTIONS if sys.argv[1] == "kiln" else [])
port = server.add_insecure_port("127.0.0.1:0")
server.start()
channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=CHANNEL_OPTIONS)
grpc.channel_ready_future(channel).result(timeout=5)
time.sleep(80)  # five pings, with no call (gRPC counts its strikes from the first)
print(channel._channel.check_connectivity_state(False))
"""
TEST = "test_keepalive.py::test_idle_connections_survive_keepalive_pings"

_procs: dict[str, subprocess.Popen] = {}


def start() -> None:
    """Start both connections, once."""
    if not _procs:
        _procs.update({server: subprocess.Popen([sys.executable, "-c", IDLE, server],
                                                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                                text=True)
                       for server in ("kiln", "defaults")})


def results(timeout: float = 150) -> dict[str, tuple[str, str]]:
    """(stdout, stderr) of each, waiting for them to end."""
    start()
    return {server: p.communicate(timeout=timeout) for server, p in _procs.items()}


def stop() -> None:
    for p in _procs.values():
        if p.poll() is None:
            p.kill()
            p.wait()
