"""What a networked bubblewrap sandbox may reach: a packet filter on the sandbox's own cgroup.

A sandbox without network has a network namespace of its own with only a loopback: it reaches
nothing (bwrap's `--unshare-net`). A task that allows network (`network: true`) shares the
service's namespace, where the pod's own ports, the node's cloud metadata and the cluster's
Kiln services would all be in reach of the model's code. So each such sandbox gets, for as
long as it lives, one rule at the top of the `filter` table's OUTPUT chain (IPv4 and IPv6)
that sends every packet its processes send (matched by the socket's cgroup v2, `-m cgroup
--path`, which nothing inside can leave) through a shared policy chain:

- any address of this host or pod (`addrtype LOCAL`: loopback and the pod's own IPs) is
  refused, except port 53 (a local DNS resolver): under `kiln run` every service of the job
  listens there, and in a pod its health, metrics, gRPC and OpenAI ports do;
- link-local addresses (169.254.0.0/16: cloud metadata, fe80::/10) and the IPv6 metadata
  address fd00:ec2::254 are refused;
- Kiln's ports (`kiln.api.ports`, plus the job's OpenAI port) are refused on every address,
  so no other pod's Kiln service is reachable either.

Refusals are REJECTs: a connect fails at once with ECONNREFUSED instead of hanging. The policy
chain is named after a hash of its content, created once per network namespace and never
changed, so services with different port lists never rewrite each other's rules. Matching on
the cgroup rather than the uid leaves every other process of the host alone, whatever its uid.

The docker backend's networked containers get the same policy by their network rather than
their cgroup (`BridgeEgress`): they sit on a bridge network of their own
(`docker_backend.NETWORK`), whose subnet is known, and their packets reach this network
namespace as forwarded (`FORWARD`: to other hosts) or delivered (`INPUT`: to this host's own
addresses, the bridge's gateway included) rather than sent, so two jumps on the subnet send
them through the same policy chain. A forwarded packet is never to a local address, a delivered
one always is: the chain's rules apply to each as they should. This needs root in the network
namespace the engine's bridge lives in (the service's own, for the podman service `kiln run`
starts).

Not covered: destinations beyond these (the internet, other cluster services on other
ports): that is the NetworkPolicy's job.
"""
from __future__ import annotations

import hashlib
import secrets
import shutil
import subprocess
import threading

from kiln.api.ports import RESERVED

from .interface import SandboxError

#: Ports refused on every address (the job's OpenAI port is added where there is one).
KILN_PORTS = tuple(sorted(RESERVED))
IPV4_BLOCKED = ("169.254.0.0/16",)
IPV6_BLOCKED = ("fe80::/10", "fd00:ec2::254/128")
TOOLS = ("iptables", "ip6tables")
_lock = threading.Lock()
#: (tool, chain) known to exist in this process's network namespace (never deleted).
_made: set[tuple[str, str]] = set()


def _run(tool: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    res = subprocess.run([tool, "-w", *args], capture_output=True, text=True)
    if check and res.returncode != 0:
        raise SandboxError(f"{tool} {' '.join(args)} failed: {res.stderr.strip()}")
    return res


def policy_rules(tool: str, ports: tuple[int, ...]) -> list[list[str]]:
    """The policy chain's rules (without `-A CHAIN`), in order."""
    rules = [["-p", proto, "--dport", "53", "-m", "addrtype", "--dst-type", "LOCAL",
              "-j", "RETURN"] for proto in ("udp", "tcp")]
    rules.append(["-m", "addrtype", "--dst-type", "LOCAL", "-j", "REJECT"])
    for net in (IPV4_BLOCKED if tool == "iptables" else IPV6_BLOCKED):
        rules.append(["-d", net, "-j", "REJECT"])
    for proto in ("tcp", "udp"):
        rules.append(["-p", proto, "-m", "multiport", "--dports", ",".join(map(str, ports)),
                      "-j", "REJECT"])
    return rules


def chain_name(ports: tuple[int, ...]) -> str:
    rules = [policy_rules(tool, ports) for tool in TOOLS]
    digest = hashlib.sha256(repr(rules).encode()).hexdigest()
    return f"KILN-EGRESS-{digest[:10]}"


def check_host() -> None:
    for tool in TOOLS:
        if shutil.which(tool) is None:
            raise SandboxError(f"{tool} not found: a sandbox with network needs it (install "
                               "iptables) to keep the pod's ports and cloud metadata out of reach")


class EgressPolicy:
    """The egress rules of one networked sandbox, by its cgroup v2 path."""

    def __init__(self, cgroup_path: str, extra_ports: tuple[int, ...] = ()) -> None:
        self.cgroup_path = cgroup_path
        self.ports = tuple(sorted(set(KILN_PORTS) | set(extra_ports)))
        self.chain = chain_name(self.ports)
        self._jump = ["OUTPUT", "-m", "cgroup", "--path", cgroup_path, "-j", self.chain]

    def _ensure_chain(self, tool: str) -> None:
        if (tool, self.chain) in _made or _run(tool, "-S", self.chain, check=False).returncode == 0:
            _made.add((tool, self.chain))
            return
        # Filled under a name of its own, then renamed: no sandbox ever jumps to a chain
        # another service is still filling. A lost race leaves the winner's (same) chain.
        tmp = f"KILN-EGTMP-{secrets.token_hex(5)}"
        _run(tool, "-N", tmp)
        for rule in policy_rules(tool, self.ports):
            _run(tool, "-A", tmp, *rule)
        if _run(tool, "-E", tmp, self.chain, check=False).returncode != 0:
            _run(tool, "-F", tmp)
            _run(tool, "-X", tmp)
        _made.add((tool, self.chain))

    def install(self) -> None:
        check_host()
        with _lock:
            try:
                for tool in TOOLS:
                    self._ensure_chain(tool)
                    _run(tool, "-I", *self._jump)
            except BaseException:
                self.remove()
                raise

    def remove(self) -> None:
        """Delete this sandbox's jumps (the shared chain stays); idempotent."""
        with _lock:
            for tool in TOOLS:
                _run(tool, "-D", *self._jump, check=False)


def stale_jumps(cgroup_prefix: str) -> list[tuple[str, list[str]]]:
    """OUTPUT rules of this module matching a cgroup whose name starts with `cgroup_prefix`
    (a killed service's sandboxes), as (tool, the rule's arguments)."""
    found = []
    for tool in TOOLS:
        if shutil.which(tool) is None:
            continue
        listing = _run(tool, "-S", "OUTPUT", check=False).stdout
        for line in listing.splitlines():
            args = line.split()
            if args[:2] == ["-A", "OUTPUT"] and f"/{cgroup_prefix}" in line \
                    and "KILN-EGRESS-" in line:
                found.append((tool, args[2:]))
    return found


def remove_stale_jumps(cgroup_prefix: str) -> int:
    jumps = stale_jumps(cgroup_prefix)
    with _lock:
        for tool, args in jumps:
            _run(tool, "-D", "OUTPUT", *args, check=False)
    return len(jumps)


class BridgeEgress:
    """The egress rules of a bridge network's containers, by the network's IPv4 subnet: what
    they send to this host (`INPUT`) or through it (`FORWARD`) goes through the policy chain.
    Shared by every container on the network and never removed (like the chain itself), so
    `ensure` adds the jumps only where they are missing."""

    def __init__(self, subnet: str, extra_ports: tuple[int, ...] = ()) -> None:
        self.subnet = subnet
        self.policy = EgressPolicy("", extra_ports)
        self.chain = self.policy.chain
        # Conntrack's replies to connections this host opened into a container are no egress
        # of the container's: they go on; anything it opens goes through the chain.
        self._jumps = [[hook, "-s", subnet, "-m", "conntrack", "!", "--ctstate",
                        "ESTABLISHED,RELATED", "-j", self.chain] for hook in ("INPUT", "FORWARD")]

    def ensure(self) -> None:
        """The jumps, at the top of their chains (before the engine's own ACCEPTs)."""
        if shutil.which("iptables") is None:
            raise SandboxError("iptables not found: a docker sandbox with network needs it "
                               "(install iptables) to keep this host's ports and cloud "
                               "metadata out of its reach")
        with _lock:
            self.policy._ensure_chain("iptables")
            for jump in self._jumps:
                if _run("iptables", "-C", *jump, check=False).returncode != 0:
                    _run("iptables", "-I", *jump)

    def remove(self) -> None:
        """Delete the jumps (a network about to be removed; tests); idempotent."""
        with _lock:
            for jump in self._jumps:
                while _run("iptables", "-D", *jump, check=False).returncode == 0:
                    pass

    def installed(self) -> bool:
        return all(_run("iptables", "-C", *jump, check=False).returncode == 0
                   for jump in self._jumps)
