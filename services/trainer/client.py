"""The trainer's client: start a stage and follow it (the stage driver), and fetch a finished
stage's weights (a frozen deployment of the job), over gRPC.

Blocking calls (the driver runs in one thread and polls). Every call is idempotent, so a lost
reply is retried (`call_with_retry`; a broken export stream starts over).
"""
from __future__ import annotations

import logging
import time
from pathlib import Path

import grpc

from kiln import tls
from kiln.protos.kiln.v1 import trainer_pb2, trainer_pb2_grpc
from kiln.services.common.retry import call_with_retry
from kiln.services.common.server import CHANNEL_OPTIONS
from kiln.services.trainer.wire import ExportError, ExportWriter, TrainerStatus, status_from_proto

__all__ = ["TrainerClient", "TrainerStatus", "ExportError"]

log = logging.getLogger("kiln.trainer.client")
# Not there yet (the stage runs, or the trainer restarts): ask again later.
_WAIT_CODES = {grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNAVAILABLE,
               grpc.StatusCode.DEADLINE_EXCEEDED}


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

    def fetch_stage_export(self, stage: str, dest: Path, *, poll_s: float = 5.0,
                           should_stop=lambda: False) -> ExportWriter:
        """Download stage `stage`'s final weights into `dest` (whole, or not at all), waiting
        for the stage to finish; raises ValueError for a stage the job does not have."""
        request = trainer_pb2.FetchStageExportRequest(stage=stage)
        waited = False
        while not should_stop():
            writer = ExportWriter(dest)
            try:
                writer.write(self._stub.FetchStageExport(request, timeout=3600))
                return writer
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                    raise ValueError(exc.details()) from exc
                if exc.code() not in _WAIT_CODES:
                    raise
                if not waited:
                    log.info("stage %s: waiting for its weights (%s)", stage, exc.details())
                    waited = True
            except ExportError as exc:
                log.warning("stage %s: export arrived broken (%s); fetching again", stage, exc)
            time.sleep(poll_s)
        raise InterruptedError(f"stopped while waiting for stage {stage}'s weights")

    def close(self) -> None:
        self._channel.close()
