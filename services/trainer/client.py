"""The trainer's client: start a stage and follow it (the stage driver), over gRPC.

Blocking calls (the driver runs in one thread and polls). Both calls are idempotent, so a lost
reply is retried (`call_with_retry`).
"""
from __future__ import annotations

from kiln import tls
from kiln.protos.kiln.v1 import trainer_pb2, trainer_pb2_grpc
from kiln.services.common.retry import call_with_retry
from kiln.services.common.server import CHANNEL_OPTIONS
from kiln.services.trainer.wire import TrainerStatus, status_from_proto

__all__ = ["TrainerClient", "TrainerStatus"]


class TrainerClient:
    def __init__(self, target: str) -> None:
        self._channel = tls.channel(target, "trainer", CHANNEL_OPTIONS)
        self._stub = trainer_pb2_grpc.TrainerStub(self._channel)

    def start_stage(self, name: str) -> TrainerStatus:
        """Start (or continue) stage `name`; returns at once."""
        return status_from_proto(call_with_retry(
            self._stub.RunStage, trainer_pb2.RunStageRequest(stage=name), timeout=30))

    def status(self) -> TrainerStatus:
        return status_from_proto(call_with_retry(
            self._stub.GetTrainerStatus, trainer_pb2.TrainerStatusRequest(), timeout=30))

    def close(self) -> None:
        self._channel.close()
