"""Keepalive: a server built with Kiln's options accepts the keepalive pings of Kiln's clients on
an idle connection. gRPC refuses a third ping within its 5-minute default with GOAWAY
"too_many_pings" (the control: a server with gRPC's defaults), which a misspelt option key
would silently bring back; the real cadence (15 s) is what is tested, so this takes 80 s."""
from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

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


def test_idle_connections_survive_keepalive_pings() -> None:
    procs = {server: subprocess.Popen([sys.executable, "-c", IDLE, server], stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True)
             for server in ("kiln", "defaults")}
    out = {server: p.communicate(timeout=150) for server, p in procs.items()}
    kiln_out, kiln_err = out["kiln"]
    assert "too_many_pings" not in kiln_err
    assert kiln_out.strip() == "2"  # READY
    # The control: gRPC's server defaults send GOAWAY and the channel goes idle.
    assert "too_many_pings" in out["defaults"][1]
    assert out["defaults"][0].strip() != "2"
