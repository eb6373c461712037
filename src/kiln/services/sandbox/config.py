"""Typed configuration of the sandbox backends and their resource limits.

`SandboxLimits` holds what every backend enforces (memory, pids, CPU, timeout, network, output
cap); `BubblewrapConfig` and `DockerConfig` are the two backends, told apart by their `type`
literal, so a job spec's `sandbox:` block maps onto `SandboxConfig` field for field.

Not covered here: how a backend applies the limits (see `bubblewrap.py`, `docker_backend.py`).
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, field_validator

from kiln.api.base import quantity_value

#: Output kept per stream (stdout, stderr) of one exec before the rest is dropped and a
#: truncation marker is appended. 1 MiB holds any sensible test log and bounds memory at
#: 2 MiB per running command.
DEFAULT_OUTPUT_LIMIT_BYTES = 1 << 20

#: Workspace size when the job names none: room for a checked-out repository and its build,
#: small enough that a runaway write stops long before it matters.
DEFAULT_DISK_BYTES = 1 << 30

#: Prefix of every cgroup, container, volume and workspace the sandbox creates; the reaper
#: only ever touches names that start with it.
NAME_PREFIX = "kiln-sbx"

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(value: int | str, field: str = "size") -> int:
    """Parse `512m`, `2Gi`, `1048576` into bytes; raise ValueError naming `field` otherwise."""
    if isinstance(value, int):
        if value <= 0:
            raise ValueError(f"{field}: must be positive, got {value}")
        return value
    match = _SIZE_RE.match(str(value))
    if not match:
        raise ValueError(f"{field}: cannot parse size {value!r} (examples: 512m, 2Gi, 1048576)")
    number, unit = match.groups()
    unit = (unit or "").lower().rstrip("b").rstrip("i")
    size = int(float(number) * _SIZE_UNITS[unit])
    if size <= 0:
        raise ValueError(f"{field}: must be positive, got {value!r}")
    return size


class SandboxLimits(BaseModel):
    """Resource limits of one sandbox; the same meaning on every backend."""

    model_config = ConfigDict(extra="forbid")

    memory_bytes: int = 512 << 20
    """Memory limit of the whole process tree; exceeding it gets the tree OOM-killed."""
    pids: int = 256
    """Maximum number of processes and threads alive at once (holds fork bombs)."""
    cpu: float = 1.0
    """CPU cores the sandbox may use (CFS quota)."""
    timeout_seconds: float = 60.0
    """Default wall-clock limit of one exec; the whole process tree is killed when it passes."""
    network: bool = False
    """Give the sandbox the host's network, less this host's own addresses, link-local ones
    and Kiln's ports (`egress.py`). Off: the sandbox has only its own loopback."""
    output_limit_bytes: int = DEFAULT_OUTPUT_LIMIT_BYTES
    """Bytes of stdout and of stderr kept per exec; the rest is dropped behind a marker."""
    disk_bytes: int = DEFAULT_DISK_BYTES
    """Size of the workspace, a filesystem of its own: a write past it fails with ENOSPC inside
    the sandbox, and the host's disk never holds more than this per sandbox."""

    @field_validator("memory_bytes", mode="before")
    @classmethod
    def _memory(cls, value: int | str) -> int:
        return parse_size(value, "memory_bytes")

    @field_validator("disk_bytes", mode="before")
    @classmethod
    def _disk(cls, value: int | str) -> int:
        return parse_size(value, "disk_bytes")

    @field_validator("output_limit_bytes", mode="before")
    @classmethod
    def _output(cls, value: int | str) -> int:
        return parse_size(value, "output_limit_bytes")

    @field_validator("pids")
    @classmethod
    def _pids(cls, value: int) -> int:
        if value < 4:
            raise ValueError(f"pids: at least 4 are needed to start a shell, got {value}")
        return value

    @field_validator("cpu", "timeout_seconds")
    @classmethod
    def _positive(cls, value: float) -> float:
        if value <= 0:
            raise ValueError(f"must be positive, got {value}")
        return value


class BubblewrapConfig(BaseModel):
    """Local backend: bubblewrap namespaces + cgroup limits, one unprivileged uid."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["bubblewrap"] = "bubblewrap"
    limits: SandboxLimits = Field(default_factory=SandboxLimits)
    owner: str = "local"
    """Who owns the sandboxes (a job or service name); part of every cgroup/workspace name."""
    state_dir: Path = Path("/tmp/kiln-sandbox")
    """Host folder under which each sandbox gets its workspace."""
    rootfs: Path | None = None
    """A root file system to use instead of the host's read-only /usr (e.g. a debootstrap)."""
    uid: int = 65534
    gid: int = 65534
    """Unprivileged identity the sandboxed commands run as (on the host too)."""
    cgroup_root: Path = Path("/sys/fs/cgroup")
    egress_ports: list[int] = Field(default_factory=list)
    """Ports a networked sandbox may not reach on any address, besides Kiln's own
    (`egress.py`): the job's OpenAI port."""
    seccomp: bool = True
    """Load the syscall filter (`seccomp.py`) into every sandboxed command. Off only to measure
    what it costs: without it the model's code reaches the whole kernel surface."""
    workspace_fs: Literal["ext4", "tmpfs"] = "ext4"
    """What the workspace quota is made of (`quota.py`): a loop-mounted ext4 image on the state
    folder's disk, or a tmpfs (no loop device needed; counts towards the memory limit)."""
    etc_files: list[str] = Field(
        default_factory=lambda: [
            "/etc/alternatives", "/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d",
            "/etc/localtime", "/etc/nsswitch.conf", "/etc/ssl", "/etc/ca-certificates",
            "/etc/python3.11", "/etc/gitconfig", "/etc/mime.types",
        ]
    )
    """Host /etc entries bound read-only into the sandbox (missing ones are skipped); the rest
    of /etc (passwd, shadow, hostname, resolv.conf...) stays invisible."""

    @field_validator("owner")
    @classmethod
    def _owner(cls, value: str) -> str:
        return check_owner(value)


class DockerConfig(BaseModel):
    """Docker Engine API backend: the dind sidecar in a pod, podman's socket elsewhere."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["docker"] = "docker"
    limits: SandboxLimits = Field(default_factory=SandboxLimits)
    owner: str = "local"
    image: str = "localhost/kiln-sandbox:latest"
    base_url: str | None = None
    """Engine socket, e.g. unix:///run/dind/docker.sock; None means DOCKER_HOST or a podman
    service started by `podman_service.PodmanService`."""
    user: str = "65534:65534"
    init: list[str] | None = None
    """PID 1 of the container; None means a small python3 loop that reaps zombies (the image
    must then have python3)."""
    workdir: str = "/workspace"
    egress_ports: list[int] = Field(default_factory=list)
    """Ports a networked container may not reach on any address, besides Kiln's own
    (`egress.py`): the job's OpenAI port."""
    ulimits: dict[str, int] = Field(default_factory=lambda: {"nofile": 20000, "nproc": 4096})
    """Explicit ulimits: podman under root without CAP_SYS_RESOURCE cannot raise the defaults."""

    @field_validator("owner")
    @classmethod
    def _owner(cls, value: str) -> str:
        return check_owner(value)


SandboxConfig = Annotated[BubblewrapConfig | DockerConfig, Field(discriminator="type")]
_CONFIG_ADAPTER: TypeAdapter[BubblewrapConfig | DockerConfig] = TypeAdapter(SandboxConfig)


def parse_config(data: dict) -> BubblewrapConfig | DockerConfig:
    """Build a backend config from a plain mapping (a job spec's sandbox block)."""
    backend = data.get("type")
    if backend not in ("bubblewrap", "docker"):
        raise ValueError(f"type: unknown sandbox backend {backend!r} (bubblewrap | docker)")
    return _CONFIG_ADAPTER.validate_python(data)


_OWNER_RE = re.compile(r"^[a-z0-9][a-z0-9-]{0,39}$")


def check_owner(owner: str) -> str:
    """Owners end up in cgroup and container names: lowercase letters, digits and dashes."""
    if not _OWNER_RE.match(owner):
        raise ValueError(
            f"owner: {owner!r} must be 1-40 lowercase letters, digits or dashes, "
            "starting with a letter or digit"
        )
    return owner


def config_from_spec(spec, owner: str) -> BubblewrapConfig | DockerConfig:
    """Backend config from an RLJob's `spec.sandbox` (kiln.api.spec.SandboxSpec)."""
    # The manifest's sizes are Kubernetes quantities (`500M` is 10^6 bytes, `500Mi` 2^20):
    # read as such here, not by `parse_size`'s shorthand, where `m` means MiB.
    limits = SandboxLimits(memory_bytes=int(quantity_value(spec.memory)), pids=spec.pids,
                           cpu=spec.cpu, timeout_seconds=spec.timeout_seconds,
                           network=spec.network, output_limit_bytes=spec.output_limit_bytes,
                           disk_bytes=int(quantity_value(spec.disk)))
    if spec.backend == "bubblewrap":
        return BubblewrapConfig(limits=limits, owner=owner, workspace_fs=spec.workspace_fs,
                                rootfs=Path(spec.rootfs) if spec.rootfs else None)
    if spec.backend == "docker":
        data: dict = {"limits": limits, "owner": owner}
        if spec.image:
            data["image"] = spec.image
        return DockerConfig(**data)
    raise ValueError(f"backend: unknown sandbox backend {spec.backend!r} (bubblewrap | docker)")
