"""Egress of real docker-backend containers (podman's Docker API, the project's own helper):
none without network; with network, the same policy as a networked bubblewrap sandbox's --
this host's own addresses (the bridge's gateway included), link-local ones (cloud metadata)
and Kiln's ports anywhere are refused, while another outside destination stays reachable
(the positive control), and the host itself stays unfiltered.

The machines this runs on answer TCP for most outside addresses (a transparent proxy), the
metadata address 169.254.169.254 included: a refusal seen here is the filter's."""
from __future__ import annotations

import asyncio
import ipaddress
import shutil
import socket
import uuid

import pytest

from kiln.api.ports import GRPC_PORT, METRICS_PORT, RENDEZVOUS_PORT
from kiln.services.sandbox.config import DockerConfig, SandboxLimits
from kiln.services.sandbox.docker_backend import make_client
from kiln.services.sandbox.docker_network import NETWORK
from kiln.services.sandbox.egress import BridgeEgress
from kiln.services.sandbox.factory import leftovers, make_sandbox, reap_orphans

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not all(shutil.which(t) for t in ("podman", "runc", "iptables")),
                                 reason="podman, runc and iptables are needed")]

OUTSIDE = "203.0.113.1"  # TEST-NET-3: reached through the machine's default route
PROBE = """
import socket, sys
for spec in sys.argv[1:]:
    host, port = spec.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=3).close()
        print(spec, "OK")
    except OSError as exc:
        print(spec, type(exc).__name__)
"""


@pytest.fixture(scope="module")
def engine():
    """A podman service and image on a root of this module's own (kept between runs, as the
    default root is): another test's service on the default root would remove the socket
    when it stops, and pytest's rotation of its temporary folders would pull storage from
    under a running container."""
    from kiln.services.sandbox.podman_service import DEFAULT_ROOT, PodmanService, build_host_image
    root = DEFAULT_ROOT.with_name(DEFAULT_ROOT.name + "-egress")
    with PodmanService(root) as service:
        build_host_image(root)
        yield service


@pytest.fixture
def listener():
    srv = socket.socket()
    srv.bind(("0.0.0.0", 0))
    srv.listen(16)
    yield srv.getsockname()[1]
    srv.close()


def _config(engine, network: bool, **extra) -> DockerConfig:
    return DockerConfig(owner=f"d{uuid.uuid4().hex[:8]}", base_url=engine.base_url,
                        limits=SandboxLimits(memory_bytes="128m", pids=64, timeout_seconds=30,
                                             network=network), **extra)


def _probe(config: DockerConfig, targets: list[str]) -> dict[str, str]:
    async def go():
        async with make_sandbox(config) as sb:
            return await sb.exec(["python3", "-c", PROBE, *targets], timeout=60)

    try:
        res = asyncio.run(go())
    finally:
        reap_orphans(config)
    assert res.exit_code == 0, res.stderr
    return dict(line.rsplit(" ", 1) for line in res.stdout.splitlines())


def _host_address() -> str:
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    probe.connect((OUTSIDE, 9))  # picks the source address of the default route; sends nothing
    try:
        return probe.getsockname()[0]
    finally:
        probe.close()


def _outside_reachable(port: int) -> bool:
    try:
        socket.create_connection((OUTSIDE, port), timeout=3).close()
        return True
    except OSError:
        return False


def test_container_without_network_reaches_nothing(engine, listener):
    config = _config(engine, False)
    got = _probe(config, [f"{_host_address()}:{listener}", f"{OUTSIDE}:80", "169.254.169.254:80"])
    assert "OK" not in got.values(), got
    assert leftovers(config) == []


def test_networked_container_is_filtered(engine, listener):
    if not _outside_reachable(80):
        pytest.skip(f"{OUTSIDE}:80 does not answer from this host: no positive control")
    config = _config(engine, True, egress_ports=[8443])
    # Made (with its filter) on first use: the network's gateway is this host's address on it.
    _probe(config, [])
    subnet = make_client(config).networks.get(NETWORK).attrs["IPAM"]["Config"][0]["Subnet"]
    gateway = str(next(ipaddress.ip_network(subnet).hosts()))
    # The jumps outlive every container: take them away, so this very start must put them back.
    BridgeEgress(subnet, (8443,)).remove()
    refused = [f"{gateway}:{listener}", f"{_host_address()}:{listener}", "169.254.169.254:80",
               f"{OUTSIDE}:{GRPC_PORT}", f"{OUTSIDE}:{METRICS_PORT}",
               f"{OUTSIDE}:{RENDEZVOUS_PORT}", f"{OUTSIDE}:8443"]
    got = _probe(config, [f"{OUTSIDE}:80", *refused])
    assert got[f"{OUTSIDE}:80"] == "OK", got  # the container does have a network
    assert {t: got[t] for t in refused} == {t: "ConnectionRefusedError" for t in refused}
    assert BridgeEgress(subnet, (8443,)).installed()
    # The host itself is not filtered: only what comes from the containers' subnet is.
    socket.create_connection(("127.0.0.1", listener), timeout=3).close()
    assert leftovers(config) == []
