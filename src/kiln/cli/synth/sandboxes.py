"""The sandboxes every `kiln synth` pipeline verifies in: one config per run, from `--backend`
and the pipeline's limits, and for the docker backend a podman service this process starts and
stops around the run (as `kiln sandbox verify` does), since no sandbox service runs here."""
from __future__ import annotations

import contextlib


@contextlib.contextmanager
def synth_sandboxes(backend: str, owner: str, **limits):
    """The sandbox config to run in for the duration of the block. `limits`: the sandbox
    config's (memory_bytes, disk_bytes, pids, cpu, timeout_seconds)."""
    from kiln.services.sandbox.config import parse_config

    config = parse_config({"type": backend, "owner": owner, "limits": limits})
    if config.type != "docker":
        yield config
        return
    from kiln.services.sandbox.podman_service import LocalEngine

    engine = LocalEngine(config)
    try:
        yield engine.__enter__()
    finally:
        engine.__exit__(None, None, None)
