"""The operator's side of the control plane: the trainer, rollout and buffer of one RLJob as
`kiln.control` Protocols over gRPC, for the stage driver (`kiln.operator.driving`).

The operator cannot use the services' own clients (they sit a floor above it, and the operator
stays free of their dependencies); these speak the same protos through the same converters (`kiln.protos.control`), so both drivers see one wire.
`Controls.open` makes all three for a job from its addresses; UNAVAILABLE and DEADLINE_EXCEEDED
are `TRANSIENT` (a pod restarting), which the driver waits out.
"""
from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Callable

import grpc

from kiln import tls
from kiln.control import Evaluation, ModeRequest, RolloutStatus, TrainerStatus, combined_status
from kiln.protos import control as wire
from kiln.protos.kiln.v1 import (buffer_pb2, buffer_pb2_grpc, rollout_pb2, rollout_pb2_grpc,
                                 trainer_pb2, trainer_pb2_grpc)
from kiln.tls import Bundle

# A pod restarting or not yet scheduled; the operator imports nothing of kiln.services.
TRANSIENT_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})


class Unavailable(Exception):
    """A job's service did not answer (restarting, not scheduled yet); worth waiting for."""


TRANSIENT = (Unavailable,)


def _call(channel: grpc.Channel, method: Callable, request, timeout: float, what: str):
    try:
        return method(request, timeout=timeout)
    except grpc.RpcError as exc:
        if exc.code() in TRANSIENT_CODES:
            raise Unavailable(f"{what}: {exc.code().name}") from exc
        # A service answers health checks while it builds and UNIMPLEMENTED for the rest (and
        # a pod being replaced may briefly be an older one): waited out like UNAVAILABLE, up to
        # the driver's limit, after which the job fails with this message.
        if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
            raise Unavailable(f"{what}: UNIMPLEMENTED (still starting, or not a Kiln service "
                              f"of this version)") from exc
        raise RuntimeError(f"{what}: {exc.code().name}: {exc.details()}") from exc


class _Service:
    """One service's stub, on a channel to wherever `address()` says now: an address map can
    change (a service placed after the driver started), so it is asked again on every call."""

    component = ""

    def __init__(self, address: Callable[[], str], stub_class, timeout: float = 30.0,
                 credentials: Callable[[], Bundle | None] = lambda: None) -> None:
        self._address, self._stub_class, self.timeout = address, stub_class, timeout
        self._credentials = credentials
        self._target = ""
        self._channel: grpc.Channel | None = None

    def _connect(self) -> grpc.Channel:
        target = self._address()
        if self._channel is None or target != self._target:
            if self._channel is not None:
                self._channel.close()
            # Control messages are small: gRPC's default size limits do.
            self._channel = tls.channel(target, self.component, bundle=self._credentials())
            self._target = target
            self._stub = self._stub_class(self._channel)
        return self._channel

    def _rpc(self, method: str, request, timeout: float | None = None):
        channel = self._connect()
        return _call(channel, getattr(self._stub, method), request,
                     timeout or self.timeout, f"{type(self).__name__} {method}")

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None


class GrpcTrainer(_Service):
    component = "trainer"

    def __init__(self, address: Callable[[], str], timeout: float = 30.0,
                 credentials: Callable[[], Bundle | None] = lambda: None) -> None:
        super().__init__(address, trainer_pb2_grpc.TrainerStub, timeout, credentials)

    def start_stage(self, name: str) -> TrainerStatus:
        return wire.trainer_status_from_proto(
            self._rpc("RunStage", trainer_pb2.RunStageRequest(stage=name)))

    def status(self) -> TrainerStatus:
        return wire.trainer_status_from_proto(
            self._rpc("GetTrainerStatus", trainer_pb2.TrainerStatusRequest()))


class GrpcRollout(_Service):
    component = "rollout"

    def __init__(self, address: Callable[[], str], timeout: float = 30.0,
                 credentials: Callable[[], Bundle | None] = lambda: None) -> None:
        super().__init__(address, rollout_pb2_grpc.RolloutStub, timeout, credentials)

    def set_mode(self, mode: ModeRequest) -> RolloutStatus:
        return wire.rollout_status_from_proto(self._rpc("SetMode", wire.mode_to_proto(mode)))

    def evaluate(self, task_set: str, *, samples: int, greedy: bool) -> Evaluation:
        # Long (a whole held-out set); one cut short by a restart is asked again.
        req = rollout_pb2.EvaluateRequest(task_set=task_set, samples=samples, greedy=greedy)
        return wire.evaluation_from_proto(self._rpc("Evaluate", req, timeout=3600))

    def status(self) -> RolloutStatus:
        return wire.rollout_status_from_proto(
            self._rpc("GetStatus", rollout_pb2.RolloutStatusRequest()))


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


class GrpcRolloutReplicas:
    """Every rollout replica of a job behind one RolloutControl. The rollout Service is
    headless, so its name resolves to each ready pod; every call looks again, so that pods
    added or removed (autoscaling, a restart) are seen at the next poll. An order goes to each
    pod whose mode differs from it; the status is theirs combined (`combined_status`)."""

    def __init__(self, address: Callable[[], str], timeout: float = 30.0,
                 credentials: Callable[[], Bundle | None] = lambda: None,
                 resolver: Callable[[str], list[str]] = resolve) -> None:
        self._address, self._timeout, self._credentials = address, timeout, credentials
        self._resolve = resolver
        self._pods: dict[str, GrpcRollout] = {}
        self._last: dict[str, RolloutStatus] = {}

    def _replicas(self) -> dict[str, GrpcRollout]:
        targets = self._resolve(self._address())
        for gone in set(self._pods) - set(targets):
            self._pods.pop(gone).close()
            self._last.pop(gone, None)
        for t in targets:
            if t not in self._pods:
                self._pods[t] = GrpcRollout(lambda t=t: t, self._timeout, self._credentials)
        return dict(self._pods)

    def _each(self, fn: Callable[[str, GrpcRollout], RolloutStatus]) -> list[RolloutStatus]:
        out, down = [], None
        for target, pod in self._replicas().items():
            try:
                self._last[target] = fn(target, pod)
                out.append(self._last[target])
            except Unavailable as exc:  # one pod restarting or going away
                down = exc
        if not out and down is not None:
            raise down
        return out

    def set_mode(self, mode: ModeRequest) -> RolloutStatus:
        def order(target: str, pod: GrpcRollout) -> RolloutStatus:
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
class BufferSummary:
    """The part of the buffer's status the driver records."""

    depth: int = 0
    dropped_stale: int = 0
    max_staleness: int = -1


class GrpcBuffer(_Service):
    component = "buffer"

    def __init__(self, address: Callable[[], str], timeout: float = 30.0,
                 credentials: Callable[[], Bundle | None] = lambda: None) -> None:
        super().__init__(address, buffer_pb2_grpc.BufferStub, timeout, credentials)

    def status(self) -> BufferSummary:
        st = self._rpc("GetStatus", buffer_pb2.GetStatusRequest())
        return BufferSummary(int(st.depth), int(st.dropped_stale), int(st.max_staleness))


@dataclass
class Controls:
    trainer: GrpcTrainer
    rollout: GrpcRolloutReplicas
    buffer: GrpcBuffer

    @classmethod
    def open(cls, address: Callable[[str], str], timeout: float = 30.0,
             credentials: Callable[[], Bundle | None] = lambda: None) -> Controls:
        """`address(component)` gives each service's host:port; `credentials()` the
        operator's certificate for the job (None: plain text)."""
        return cls(GrpcTrainer(lambda: address("trainer"), timeout, credentials),
                   GrpcRolloutReplicas(lambda: address("rollout"), timeout, credentials),
                   GrpcBuffer(lambda: address("buffer"), timeout, credentials))

    def close(self) -> None:
        for service in (self.trainer, self.rollout, self.buffer):
            service.close()
