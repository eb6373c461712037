"""Egress of real bubblewrap sandboxes: none without network; with network, this host's own
addresses, link-local ones (cloud metadata) and Kiln's ports are refused while other
destinations stay reachable, and no filter rule outlives its sandbox.

The machines this runs on answer TCP for most outside addresses (a transparent proxy), the
metadata address 169.254.169.254 included: a refusal seen here is the filter's, and a connect
that succeeds is the positive control."""
from __future__ import annotations

import asyncio
import shutil
import socket
import uuid

import pytest

from kiln.api.ports import GRPC_PORT, METRICS_PORT, RENDEZVOUS_PORT
from kiln.services.sandbox.config import BubblewrapConfig, SandboxLimits
from kiln.services.sandbox.egress import stale_jumps
from kiln.services.sandbox.factory import leftovers, make_sandbox

pytestmark = pytest.mark.skipif(shutil.which("iptables") is None, reason="iptables not installed")

OUTSIDE = "203.0.113.1"  # TEST-NET-3: reached through the machine's default route
PROBE = """
import socket, sys
for spec in sys.argv[1:]:
    host, port = spec.rsplit(":", 1)
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=3).close()
        print(spec, "OK")
    except OSError as exc:
        print(spec, type(exc).__name__)
"""


def _outside_reachable(port: int) -> bool:
    try:
        socket.create_connection((OUTSIDE, port), timeout=3).close()
        return True
    except OSError:
        return False


def _probe(config: BubblewrapConfig, targets: list[str]) -> dict[str, str]:
    async def go():
        async with make_sandbox(config) as sb:
            return await sb.exec(["python3", "-c", PROBE, *targets], timeout=30)

    res = asyncio.run(go())
    assert res.exit_code == 0, res.stderr
    return dict(line.rsplit(" ", 1) for line in res.stdout.splitlines())


@pytest.fixture
def listener():
    srv = socket.socket()
    srv.bind(("0.0.0.0", 0))
    srv.listen(16)
    yield srv.getsockname()[1]
    srv.close()


def _config(network: bool, **extra) -> BubblewrapConfig:
    return BubblewrapConfig(owner=f"n{uuid.uuid4().hex[:8]}", limits=SandboxLimits(
        memory_bytes="128m", pids=64, timeout_seconds=30, network=network), **extra)


def _host_address() -> str:
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    probe.connect((OUTSIDE, 9))  # picks the source address of the default route; sends nothing
    try:
        return probe.getsockname()[0]
    finally:
        probe.close()


def test_no_network_reaches_nothing(listener):
    config = _config(False)
    got = _probe(config, [f"127.0.0.1:{listener}", f"{OUTSIDE}:80", "169.254.169.254:80"])
    assert "OK" not in got.values(), got
    assert leftovers(config) == []


def test_network_is_filtered_and_rules_leave_with_the_sandbox(listener):
    if not _outside_reachable(80):
        pytest.skip(f"{OUTSIDE}:80 does not answer from this host: no positive control")
    config = _config(True, egress_ports=[8443])
    host = _host_address()
    refused = [f"127.0.0.1:{listener}", f"[::1]:{listener}", f"{host}:{listener}",
               "169.254.169.254:80", f"{OUTSIDE}:{GRPC_PORT}", f"{OUTSIDE}:{METRICS_PORT}",
               f"{OUTSIDE}:{RENDEZVOUS_PORT}", f"{OUTSIDE}:8443"]
    got = _probe(config, [f"{OUTSIDE}:80", *refused])
    assert got[f"{OUTSIDE}:80"] == "OK", got  # the sandbox does have a network
    assert {t: got[t] for t in refused} == {t: "ConnectionRefusedError" for t in refused}
    # The host itself is not filtered: only the sandbox's cgroup is.
    socket.create_connection(("127.0.0.1", listener), timeout=3).close()
    assert stale_jumps(f"kiln-sbx-{config.owner}-") == []
    assert leftovers(config) == []
