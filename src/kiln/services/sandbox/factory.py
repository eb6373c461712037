"""Choosing a backend, and reaping what a killed predecessor left behind.

`make_sandbox` switches on the config's `type` literal ("bubblewrap" | "docker"); `config_for`
gives a task that names its own image the docker backend in that image, and refuses it on
bubblewrap.
`reap_orphans` removes every cgroup, workspace, egress rule (`egress.py`) and container named
`kiln-sbx-<owner>-*`: call it
when a service starts, so a service killed with SIGKILL and restarted leaves nothing running.
An owner must therefore be unique to one live service (a pod name, a job name + replica).

Not covered: pools and sessions (`sessions.py`).
"""
from __future__ import annotations

import shutil

from .config import NAME_PREFIX, BubblewrapConfig, DockerConfig, parse_config
from .interface import Sandbox


def make_sandbox(config: BubblewrapConfig | DockerConfig | dict, *, client=None) -> Sandbox:
    if isinstance(config, dict):
        config = parse_config(config)
    kind = getattr(config, "type", None)
    if kind == "bubblewrap":
        from .bubblewrap import BubblewrapSandbox
        return BubblewrapSandbox(config)
    if kind == "docker":
        from .docker_backend import DockerSandbox
        return DockerSandbox(config, client=client)
    raise ValueError(f"type: unknown sandbox backend {kind!r} (bubblewrap | docker)")


def config_for(config: BubblewrapConfig | DockerConfig, image: str | None,
               task: str = "task") -> BubblewrapConfig | DockerConfig:
    """The config a task's sandbox runs with: the docker backend in the task's own `image` (the
    SWE-bench convention: one image per instance, its repository and dependencies inside);
    ValueError for bubblewrap, which runs every sandbox on the host's file system and so cannot
    give a task its image."""
    if not image:
        return config
    if isinstance(config, DockerConfig):
        return config.model_copy(update={"image": image})
    raise ValueError(f"{task}: names image {image!r}, which only the docker backend runs "
                     "(spec.sandbox.backend: docker); the bubblewrap backend runs every task on "
                     "the host's file system. Use the docker backend, or give the task's "
                     "repository as `repo` instead of `image`")


def leftovers(config: BubblewrapConfig | DockerConfig, client=None) -> list[str]:
    """Names of resources of `config.owner` that exist now (empty when all is clean)."""
    prefix = f"{NAME_PREFIX}-{config.owner}-"
    if isinstance(config, BubblewrapConfig):
        from .cgroups import list_groups
        from .egress import stale_jumps
        names = set(list_groups(config.cgroup_root, prefix))
        names.update(f"egress rule {' '.join(rule)}" for _, rule in stale_jumps(prefix))
        if config.state_dir.is_dir():
            names.update(p.name for p in config.state_dir.iterdir() if p.name.startswith(prefix))
        return sorted(names)
    from .docker_backend import LABEL_OWNER, make_client
    client = client or make_client(config)
    return sorted(c.name for c in client.containers.list(
        all=True, filters={"label": f"{LABEL_OWNER}={config.owner}"}))


def remove_tree(path) -> None:
    """`shutil.rmtree`, where an entry already gone is fine: the service that owned it may be
    removing it at the same moment (it was shutting down, not dead)."""
    def gone_is_fine(func, entry, exc_info):  # noqa: ARG001
        if not issubclass(exc_info[0], FileNotFoundError):
            raise exc_info[1]
    shutil.rmtree(path, onerror=gone_is_fine)


def reap_orphans(config: BubblewrapConfig | DockerConfig, client=None) -> list[str]:
    """Kill and remove every resource of `config.owner`; returns the names removed."""
    prefix = f"{NAME_PREFIX}-{config.owner}-"
    if isinstance(config, BubblewrapConfig):
        from .cgroups import Cgroup, list_groups
        from .quota import unmount_workspace
        from .egress import remove_stale_jumps
        names = list_groups(config.cgroup_root, prefix)
        for name in names:
            Cgroup(config.cgroup_root, name).remove()
        remove_stale_jumps(prefix)
        if config.state_dir.is_dir():
            for path in config.state_dir.iterdir():
                if path.name.startswith(prefix):
                    unmount_workspace(path / "workspace")
                    remove_tree(path)
                    names.append(path.name)
        return sorted(set(names))
    if isinstance(config, DockerConfig):
        from .docker_backend import make_client, reap_containers
        own = client is None
        client = client or make_client(config)
        try:
            return reap_containers(client, config.owner)
        finally:
            if own:
                client.close()
    raise ValueError(f"type: unknown sandbox backend {getattr(config, 'type', None)!r}")
