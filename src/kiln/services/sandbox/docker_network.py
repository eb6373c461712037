"""The network of the docker backend's networked containers, and its egress filter.

A container of a task that allows network (`network: true`) joins one bridge network kept for
Kiln's sandboxes (`NETWORK`, made on first use and never removed), not the engine's default
bridge: its subnet is then Kiln's alone, and the same egress policy as a networked bubblewrap
sandbox's (`egress.py`: this host's own addresses but DNS, link-local ones such as cloud
metadata, Kiln's ports anywhere) is put on that subnet (`egress.BridgeEgress`) before the first
such container starts. The filter covers IPv4; a network that has an IPv6 subnet is refused.

Installing the filter takes root in the network namespace of the engine's bridge: true of the
podman service `kiln run` starts (it runs beside the root sandbox service). A service that
cannot install it refuses networked containers (SandboxError) rather than start them
unfiltered.

Not covered: the containers' own options (`docker_backend.container_options`).
"""
from __future__ import annotations

import ipaddress
import threading

from .egress import BridgeEgress
from .interface import SandboxError

#: The bridge network every networked sandbox container joins.
NETWORK = "kiln-sbx-net"
_lock = threading.Lock()


def _subnets(network) -> list[str]:
    configs = (network.attrs.get("IPAM") or {}).get("Config") or []
    return [c["Subnet"] for c in configs if c.get("Subnet")]


def egress_network(client, extra_ports: tuple[int, ...] = ()) -> str:
    """The name of the network to attach a networked container to, its filter in place (once
    per client and port list). SandboxError when either cannot be had."""
    import docker

    key = ("_kiln_egress", tuple(sorted(extra_ports)))
    done = getattr(client, "_kiln_egress_done", set())
    if key in done:
        return NETWORK
    with _lock:
        try:
            try:
                network = client.networks.get(NETWORK)
            except docker.errors.NotFound:
                try:
                    network = client.networks.create(NETWORK, driver="bridge",
                                                      labels={"kiln.sandbox.network": "egress"})
                except docker.errors.APIError:
                    network = client.networks.get(NETWORK)  # another service made it first
                network.reload()
        except docker.errors.APIError as exc:
            raise SandboxError(f"network {NETWORK}: cannot make it: {exc}", retryable=True) from exc
        subnets = _subnets(network)
        v4 = [s for s in subnets if ipaddress.ip_network(s, strict=False).version == 4]
        if len(v4) != 1 or len(subnets) != 1:
            raise SandboxError(f"network {NETWORK} has subnets {subnets}: the egress filter "
                               "needs exactly one IPv4 subnet and no IPv6 (remove the network "
                               "to have it made again)")
        try:
            BridgeEgress(v4[0], extra_ports).ensure()
        except SandboxError as exc:
            raise SandboxError(f"a networked sandbox's egress filter cannot be installed, so "
                               f"none is started: {exc} (it takes root in the network "
                               "namespace of the engine's bridge)") from None
        client._kiln_egress_done = done | {key}
    return NETWORK
