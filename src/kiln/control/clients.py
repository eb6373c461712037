"""One client per control-plane service: the trainer's stage control, rollout's mode,
evaluations and status, the buffer's and weight-sync's status, and every service's health.
`kiln run`'s launcher, the operator (its stage driver and its status reader) and the services'
own clients (`kiln.services.trainer.client`, `kiln.services.rollout.client`, which
add their data-plane calls to these) all use them, so both stage drivers speak one wire.

Blocking calls: a stage driver runs in one thread and polls. The address is asked for on every
call (`address` may be a callable): a job's address map can change while its driver runs (a
service placed later, a pod rescheduled), and the channel follows it. Failures follow
`kiln.control.retry`: `ServiceUnavailable` is waited out by the driver, `ServiceError` is not.
"""
from __future__ import annotations

from typing import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kiln.control import wire
from kiln.control.channels import channel
from kiln.control.records import BufferStatus, Evaluation, ModeRequest, RolloutStatus, TrainerStatus
from kiln.control.retry import control_call
from kiln.protos.kiln.v1 import (buffer_pb2, buffer_pb2_grpc, rollout_pb2, rollout_pb2_grpc,
                                 trainer_pb2, trainer_pb2_grpc, weight_sync_pb2,
                                 weight_sync_pb2_grpc)
from kiln.tls import Bundle

Address = str | Callable[[], str]
#: Seconds a control call may take; an evaluation runs a whole held-out set, so it has its own.
CONTROL_TIMEOUT_S = 30.0
EVALUATE_TIMEOUT_S = 3600.0


class ServiceClient:
    """One service's stub on a channel to wherever `address` says now. `credentials()` gives
    the certificate to connect with (the operator's for a job); None: this process's own, if
    it has one (`kiln.control.channels`). `retry=False`: one try per call (an observer that
    polls anyway, such as the operator's status reader)."""

    component = ""
    stub_class: type = object

    def __init__(self, address: Address, *, timeout: float = CONTROL_TIMEOUT_S,
                 credentials: Callable[[], Bundle | None] = lambda: None,
                 retry: bool = True) -> None:
        self._address = address if callable(address) else (lambda: address)
        self.timeout, self._credentials, self.retry = timeout, credentials, retry
        self._target = ""
        self._channel: grpc.Channel | None = None
        self._stub = None

    @property
    def target(self) -> str:
        return self._address()

    def _connect(self) -> grpc.Channel:
        target = self._address()
        if self._channel is None or target != self._target:
            if self._channel is not None:
                self._channel.close()
            self._channel = channel(target, self.component, bundle=self._credentials())
            self._target, self._stub = target, self.stub_class(self._channel)
        return self._channel

    def stub(self):
        """The stub on a channel to the current address (a new channel when it moved)."""
        self._connect()
        return self._stub

    def _call(self, method: str, request, *, timeout: float | None = None, retry: bool = True):
        return control_call(getattr(self.stub(), method), request, timeout=timeout or self.timeout,
                            what=f"{self.component} {method}", retry=retry and self.retry)

    def health(self) -> tuple[bool, str]:
        """(serving, why not): gRPC's standard health check, one try. A service answers it
        NOT_SERVING while it builds (loads its model, recovers its log)."""
        stub = health_pb2_grpc.HealthStub(self._connect())
        try:
            resp = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=self.timeout)
        except grpc.RpcError as exc:
            return False, f"{self._target}: {exc.code().name}"
        if resp.status != health_pb2.HealthCheckResponse.SERVING:
            return False, f"{self._target}: {health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)}"
        return True, ""

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None


class TrainerControlClient(ServiceClient):
    """`kiln.control.records.TrainerControl` over gRPC."""

    component, stub_class = "trainer", trainer_pb2_grpc.TrainerStub

    def start_stage(self, name: str) -> TrainerStatus:
        """Start (or continue) stage `name`; returns at once."""
        return wire.trainer_status_from_proto(
            self._call("RunStage", trainer_pb2.RunStageRequest(stage=name)))

    def status(self) -> TrainerStatus:
        return wire.trainer_status_from_proto(
            self._call("GetTrainerStatus", trainer_pb2.TrainerStatusRequest()))

    def continue_stage(self, name: str, step: int, keep_step: int) -> TrainerStatus:
        req = trainer_pb2.ContinueStageRequest(stage=name, step=step, keep_step=keep_step)
        return wire.trainer_status_from_proto(self._call("ContinueStage", req))

    def record_scalars(self, step: int, scalars: dict[str, float]) -> None:
        """The driver's scalars for the job's TensorBoard files in its output location; once,
        not retried (a lost point is a gap in a plot)."""
        self._call("RecordScalars", trainer_pb2.RecordScalarsRequest(step=step, scalars=scalars),
                   retry=False)

    def restore_checkpoint(self, name: str, step: int, reason: str) -> TrainerStatus:
        # Restoring and exporting a model takes longer than a status call.
        req = trainer_pb2.RestoreCheckpointRequest(stage=name, step=step, reason=reason)
        return wire.trainer_status_from_proto(
            self._call("RestoreCheckpoint", req, timeout=EVALUATE_TIMEOUT_S))


class RolloutControlClient(ServiceClient):
    """`kiln.control.records.RolloutControl` over gRPC, for one rollout process."""

    component, stub_class = "rollout", rollout_pb2_grpc.RolloutStub

    def set_mode(self, mode: ModeRequest) -> RolloutStatus:
        return wire.rollout_status_from_proto(self._call("SetMode", wire.mode_to_proto(mode)))

    def evaluate(self, task_set: str, *, samples: int, greedy: bool,
                 max_tasks: int = 0) -> Evaluation:
        # Long, and its result is recorded by the caller: not retried here. One cut short by a
        # restart fails with ServiceUnavailable, and the driver asks again once it serves.
        req = rollout_pb2.EvaluateRequest(task_set=task_set, samples=samples, greedy=greedy,
                                          max_tasks=max_tasks)
        return wire.evaluation_from_proto(
            self._call("Evaluate", req, timeout=EVALUATE_TIMEOUT_S, retry=False))

    def status(self) -> RolloutStatus:
        return wire.rollout_status_from_proto(
            self._call("GetStatus", rollout_pb2.RolloutStatusRequest()))


class BufferStatusClient(ServiceClient):
    """The buffer's status, which is all a stage driver reads of it. Producers and the
    trainer use the buffer's data-plane client (`kiln.services.buffer.client`)."""

    component, stub_class = "buffer", buffer_pb2_grpc.BufferStub

    def status(self) -> BufferStatus:
        return wire.buffer_status_from_proto(self._call("GetStatus", buffer_pb2.GetStatusRequest()))


class WeightSyncStatusClient(ServiceClient):
    """Weight-sync's status, as far as the control plane reads it: the latest committed policy
    version. Publishers and subscribers use `kiln.services.weight_sync.client`."""

    component, stub_class = "weight-sync", weight_sync_pb2_grpc.WeightSyncStub

    def latest_version(self) -> int:
        """The latest committed policy version; 0 before the first."""
        return int(self._call("Status", weight_sync_pb2.StatusRequest()).policy_version)
