"""The trainer's client: the control floor's (start a stage and follow it: the stage driver's
side, `kiln.control.clients`) with the one data-plane call added, fetching a finished stage's
weights (a frozen deployment of the job), over gRPC.

Blocking calls. Every call is idempotent, so a lost reply is retried (a broken export stream
starts over).
"""
from __future__ import annotations

import logging
import time
from pathlib import Path

import grpc

from kiln.control.clients import TrainerControlClient
from kiln.control.retry import TRANSIENT
from kiln.protos.kiln.v1 import trainer_pb2
from kiln.services.trainer.wire import ExportError, ExportWriter

__all__ = ["TrainerClient", "ExportError"]

log = logging.getLogger("kiln.trainer.client")
# Not there yet (the stage runs, or the trainer restarts): ask again later.
_WAIT_CODES = TRANSIENT | {grpc.StatusCode.FAILED_PRECONDITION}


class TrainerClient(TrainerControlClient):
    def fetch_stage_export(self, stage: str, dest: Path, *, poll_s: float = 5.0,
                           should_stop=lambda: False) -> ExportWriter:
        """Download stage `stage`'s final weights into `dest` (whole, or not at all), waiting
        for the stage to finish; raises ValueError for a stage the job does not have."""
        request = trainer_pb2.FetchStageExportRequest(stage=stage)
        waited = False
        while not should_stop():
            writer = ExportWriter(dest)
            try:
                writer.write(self.stub().FetchStageExport(request, timeout=3600))
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
