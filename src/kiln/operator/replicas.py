"""The operator's side of the control plane: one RLJob's trainer, rollout replicas and buffer as
`kiln.control` Protocols, for the stage driver (`kiln.operator.driving`).

The clients are the control floor's (`kiln.control.clients`), the same ones `kiln run` uses;
what the operator adds is the fan-out over rollout replicas behind a headless Service
(`RolloutReplicas`). `Controls.open` makes all three for a job from its addresses; a service
restarting raises `ServiceUnavailable` (`TRANSIENT`), which the driver waits out.
"""
from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Callable

from kiln.control.clients import BufferStatusClient, RolloutControlClient, TrainerControlClient
from kiln.control.records import Evaluation, ModeRequest, RolloutStatus, combined_status
from kiln.control.retry import ServiceUnavailable
from kiln.tls import Bundle

TRANSIENT = (ServiceUnavailable,)


def resolve(address: str) -> list[str]:
    """`host:port` as one `ip:port` per address the name resolves to: a headless Service's name
    gives each ready pod's. The address itself when it does not resolve (yet)."""
    host, _, port = address.rpartition(":")
    try:
        infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    except (OSError, ValueError):
        return [address]
    ips = sorted({info[4][0] for info in infos})
    return [f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}" for ip in ips] or [address]


class RolloutReplicas:
    """Every rollout replica of a job behind one RolloutControl. The rollout Service is
    headless, so its name resolves to each ready pod; every call looks again, so that pods
    added or removed (autoscaling, a restart) are seen at the next poll. An order goes to each
    pod whose mode differs from it; the status is theirs combined (`combined_status`)."""

    def __init__(self, address: Callable[[], str], timeout: float = 30.0,
                 credentials: Callable[[], Bundle | None] = lambda: None,
                 resolver: Callable[[str], list[str]] = resolve) -> None:
        self._address, self._timeout, self._credentials = address, timeout, credentials
        self._resolve = resolver
        self._pods: dict[str, RolloutControlClient] = {}
        self._last: dict[str, RolloutStatus] = {}

    def _replicas(self) -> dict[str, RolloutControlClient]:
        targets = self._resolve(self._address())
        for gone in set(self._pods) - set(targets):
            self._pods.pop(gone).close()
            self._last.pop(gone, None)
        for t in targets:
            if t not in self._pods:
                self._pods[t] = RolloutControlClient(t, timeout=self._timeout,
                                                     credentials=self._credentials)
        return dict(self._pods)

    def _each(self, fn: Callable[[str, RolloutControlClient], RolloutStatus]) -> list[RolloutStatus]:
        out, down = [], None
        for target, pod in self._replicas().items():
            try:
                self._last[target] = fn(target, pod)
                out.append(self._last[target])
            except ServiceUnavailable as exc:  # one pod restarting or going away
                down = exc
        if not out and down is not None:
            raise down
        return out

    def set_mode(self, mode: ModeRequest) -> RolloutStatus:
        def order(target: str, pod: RolloutControlClient) -> RolloutStatus:
            last = self._last.get(target)
            if last is not None and (last.stage, last.mode) == (mode.stage, mode.mode):
                return pod.status()
            return pod.set_mode(mode)
        return combined_status(self._each(order))

    def serving(self) -> int:
        """Rollout pods the Service listed (ready ones) at the last order or status read, which
        the driver makes every poll."""
        return len(self._pods)

    def evaluate(self, task_set: str, *, samples: int, greedy: bool) -> Evaluation:
        pods = self._replicas()
        return pods[min(pods)].evaluate(task_set, samples=samples, greedy=greedy)

    def status(self) -> RolloutStatus:
        return combined_status(self._each(lambda target, pod: pod.status()))

    def close(self) -> None:
        for pod in self._pods.values():
            pod.close()
        self._pods.clear()


@dataclass
class Controls:
    trainer: TrainerControlClient
    rollout: RolloutReplicas
    buffer: BufferStatusClient

    @classmethod
    def open(cls, address: Callable[[str], str], timeout: float = 30.0,
             credentials: Callable[[], Bundle | None] = lambda: None) -> Controls:
        """`address(component)` gives each service's host:port; `credentials()` the
        operator's certificate for the job (None: plain text)."""
        return cls(TrainerControlClient(lambda: address("trainer"), timeout=timeout,
                                        credentials=credentials),
                   RolloutReplicas(lambda: address("rollout"), timeout, credentials),
                   BufferStatusClient(lambda: address("buffer"), timeout=timeout,
                                      credentials=credentials))

    def close(self) -> None:
        for service in (self.trainer, self.rollout, self.buffer):
            service.close()
