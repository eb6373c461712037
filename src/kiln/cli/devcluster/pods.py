"""A pod of the development cluster as the node agent keeps it: its containers as processes."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Container:
    spec: dict[str, Any]
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    proc: subprocess.Popen | None = None
    restarts: int = 0
    next_start: float = 0.0
    done: bool = False
    """An init container that exited 0."""

    @property
    def name(self) -> str:
        return self.spec["name"]


@dataclass
class Pod:
    namespace: str
    name: str
    owner: dict[str, Any]
    template_hash: str
    labels: dict[str, str]
    init: list[Container] = field(default_factory=list)
    containers: list[Container] = field(default_factory=list)
    ports: list[int] = field(default_factory=list)
    failure: str = ""
    started: float = field(default_factory=time.time)
    reported: dict[str, Any] | None = None
    """The Pod object last written to the API."""

    def processes(self) -> list[subprocess.Popen]:
        return [c.proc for c in (*self.init, *self.containers) if c.proc is not None]


def stop(procs: list[subprocess.Popen], grace: float) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()


def accepts(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False
