"""`kiln run`'s rollout replicas: worker processes `rollout`, `rollout-1`, `rollout-2`, ...,
behind one `RolloutControl` for the stage driver and a `RolloutScaler` for autoscaling.

Every worker is the rollout service's own entry point with its own engine, state directory and
task stream (`KILN_ROLLOUT_REPLICA`); all of them subscribe to weight sync and ship to the one
buffer. An order goes to each worker whose mode differs from it; the status the driver reads is
the workers' together (`kiln.control.combined_status`). Scaling never blocks the driver:

- up: the new worker's process starts at once and joins when it answers its health check; the
  driver then sees a worker out of mode and orders it, and the worker starts episodes only once
  its engine serves the trainer's current version (`ModeRequest.min_version`);
- down: the newest worker is ordered IDLE (it starts nothing new, and its episodes in flight
  still stop once their group falls beyond tau), and is stopped when it has none left or its
  episodes' timeout has passed.
"""
from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Callable

import grpc

from kiln.control.clients import RolloutControlClient
from kiln.control.records import ModeRequest, RolloutMode, RolloutStatus, combined_status

from . import processes

WORKER_PREFIX = "rollout-"
#: How long a retired worker may take to exit before it is killed.
STOP_SECONDS = 60.0


def worker_name(index: int) -> str:
    return "rollout" if index == 0 else f"{WORKER_PREFIX}{index}"


class RolloutFleet:
    def __init__(self, services: dict[str, processes.ServiceProcess],
                 start: Callable[[str], processes.ServiceProcess],
                 client: Callable[[processes.ServiceProcess], object], *,
                 drain_seconds: float, say: Callable[[str], None] = lambda s: None) -> None:
        """`services`: the launcher's processes (workers are added and removed there, so its
        supervision restarts a dead worker and its shutdown stops them all); `start(name)`
        starts a worker process; `client(process)` makes the driver's client of one."""
        self.services, self._start, self._client = services, start, client
        self.drain_seconds, self.say = drain_seconds, say
        self.active: list[str] = [n for n in services if n == "rollout" or n.startswith(WORKER_PREFIX)]
        self.joining: list[str] = []
        self.draining: dict[str, float] = {}
        """Workers ordered IDLE, stopped once their episodes are done or at this deadline."""
        self._stopping: dict[str, tuple[processes.ServiceProcess, float]] = {}
        """Retired processes sent SIGTERM, killed if still there at their deadline."""
        self._clients: dict[str, object] = {}
        self._last: dict[str, RolloutStatus] = {}

    def _of(self, name: str):
        c = self._clients.get(name)
        if c is None:
            c = self._clients[name] = self._client(self.services[name])
        return c

    # ------------------------------------------------------------------ RolloutControl
    def set_mode(self, mode: ModeRequest) -> RolloutStatus:
        self._tick()
        for name in self.active:
            last = self._last.get(name)
            if last is None or (last.stage, last.mode) != (mode.stage, mode.mode):
                self._last[name] = self._of(name).set_mode(mode)
        return self.status()

    def evaluate(self, task_set: str, *, samples: int, greedy: bool):
        return self._of(self.active[0]).evaluate(task_set, samples=samples, greedy=greedy)

    def status(self) -> RolloutStatus:
        self._tick()
        for name in self.active:
            self._last[name] = self._of(name).status()
        drained = []
        for name in self.draining:
            try:
                drained.append(self._of(name).status())
            except grpc.RpcError:
                pass  # gone already; the next tick retires it
        return combined_status([self._last[n] for n in self.active], drained)

    # ------------------------------------------------------------------ RolloutScaler
    def replicas(self) -> int:
        return len(self.active) + len(self.joining)

    def settled(self) -> bool:
        # As of the last status read (the driver's every poll, which also admits the workers
        # that became healthy and retires the drained).
        return not self.joining and not self.draining

    def scale(self, replicas: int) -> None:
        replicas = max(1, replicas)
        while self.replicas() < replicas:
            name = self._free_name()
            self.services[name] = self._start(name)
            self.joining.append(name)
            self.say(f"  rollout: starting worker {name}")
        while self.replicas() > replicas:
            if self.joining:
                self._retire(self.joining.pop())
                continue
            name = self.active.pop()
            self._of(name).set_mode(ModeRequest(RolloutMode.IDLE))
            self._last.pop(name, None)
            self.draining[name] = time.monotonic() + self.drain_seconds
            self.say(f"  rollout: draining worker {name}")

    # ------------------------------------------------------------------ joining and leaving
    def _free_name(self) -> str:
        taken = {*self.active, *self.joining, *self.draining, *self._stopping}
        return next(worker_name(i) for i in range(1, 10_000) if worker_name(i) not in taken)

    def _tick(self) -> None:
        self._reap()
        for name in list(self.joining):
            if _healthy(self.services[name]):
                self.joining.remove(name)
                self.active.append(name)
                self.say(f"  rollout: worker {name} joined")
        for name, deadline in list(self.draining.items()):
            try:
                idle = self._of(name).status().in_flight == 0
            except grpc.RpcError:
                idle = True  # gone already
            if idle or time.monotonic() > deadline:
                del self.draining[name]
                self._retire(name)

    def _retire(self, name: str) -> None:
        """SIGTERM now (the service drains and exits); reaped by a later tick, never waited
        for here, so the driver's poll goes on."""
        client = self._clients.pop(name, None)
        if client is not None and hasattr(client, "close"):
            client.close()
        svc = self.services.pop(name)
        if svc.proc.poll() is None:
            svc.proc.send_signal(signal.SIGTERM)
        self._stopping[name] = (svc, time.monotonic() + STOP_SECONDS)

    def _reap(self) -> None:
        for name, (svc, deadline) in list(self._stopping.items()):
            if svc.proc.poll() is None and time.monotonic() > deadline:
                svc.proc.kill()
            if svc.proc.poll() is not None:
                processes.kill_leftovers(svc)
                del self._stopping[name]
                self.say(f"  rollout: worker {name} stopped")

    def close(self) -> None:
        """Wait for every retired worker to be gone (the launcher's shutdown)."""
        for svc, _ in self._stopping.values():
            processes.stop(svc, timeout=STOP_SECONDS)
        self._stopping.clear()


def _healthy(svc: processes.ServiceProcess) -> bool:
    """One quick look: the port file is there and the health service says SERVING (a worker
    that died while starting is not; the launcher's supervision restarts it)."""
    port_file: Path = svc.state_dir / "ports.json"
    if svc.proc.poll() is not None or not port_file.exists():
        return False
    processes.wait_port(svc, timeout=1)
    client = RolloutControlClient(svc.address, timeout=1, retry=False)
    try:
        return client.health()[0]
    finally:
        client.close()
