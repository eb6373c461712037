"""gRPC servicer of `kiln.v1.Trainer`: protobuf <-> domain translation around `TrainerEngine`.

The engine is CPU/GPU-bound and not thread-safe, so every call runs in a worker thread under
one lock: the event loop keeps answering health checks while a step runs, and calls queue
rather than interleave. ValueError from the engine (a malformed request) becomes
INVALID_ARGUMENT; a checkpoint request without a checkpoint directory, FAILED_PRECONDITION.
"""
from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import TypeVar

import grpc

from kiln.protos.kiln.v1 import trainer_pb2, trainer_pb2_grpc
from kiln.services.common.codec import from_proto
from kiln.services.trainer.checkpoint import step_dir_name
from kiln.services.trainer.engine import TrainerEngine

T = TypeVar("T")
SERVICE_NAME = "kiln.v1.Trainer"


class TrainerServicer(trainer_pb2_grpc.TrainerServicer):
    def __init__(self, engine: TrainerEngine, engine_lock: threading.Lock | None = None,
                 stages=None) -> None:
        self.engine = engine
        self._lock = asyncio.Lock()
        # Shared with the stage runner's thread, which steps the same engine.
        self.engine_lock = engine_lock or threading.Lock()
        self.stages = stages

    def _locked(self, fn: Callable[[], T]) -> T:
        with self.engine_lock:
            return fn()

    async def _call(self, context: grpc.aio.ServicerContext, fn: Callable[[], T]) -> T:
        async with self._lock:
            try:
                return await asyncio.to_thread(self._locked, fn)
            except ValueError as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
                raise  # unreachable: abort raises

    async def ComputeLogprobs(
        self, request_iterator: AsyncIterator[trainer_pb2.LogprobsRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[trainer_pb2.LogprobsResponse]:
        async for request in request_iterator:
            seqs = [list(s.tokens) for s in request.sequences]
            if not seqs:
                yield trainer_pb2.LogprobsResponse(policy_version=self.engine.version)
                continue
            logps, version = await self._call(context, lambda: (self.engine.logprobs(seqs), self.engine.version))
            out = trainer_pb2.LogprobsResponse(policy_version=version)
            for s, lp in zip(request.sequences, logps):
                item = out.sequences.add(id=s.id)
                item.logprobs.extend(lp)
            yield out

    async def TrainStep(
        self, request: trainer_pb2.TrainStepRequest, context: grpc.aio.ServicerContext
    ) -> trainer_pb2.TrainStepResponse:
        batch = [from_proto(t) for t in request.trajectories]
        if not batch:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "TrainStep: trajectories is empty")

        def run() -> dict[str, float]:
            if request.stage:
                self.engine.stage = request.stage
            if request.kind == trainer_pb2.STEP_KIND_SFT:
                return self.engine.sft_step(batch)
            return self.engine.step(batch)

        metrics = await self._call(context, run)
        return trainer_pb2.TrainStepResponse(
            step=self.engine.step_count, policy_version=self.engine.version, metrics=metrics
        )

    async def NewVersion(
        self, request: trainer_pb2.NewVersionRequest, context: grpc.aio.ServicerContext
    ) -> trainer_pb2.TrainerStatus:
        await self._call(context, self.engine.new_version)
        return self._status()

    async def GetTrainerStatus(
        self, request: trainer_pb2.TrainerStatusRequest, context: grpc.aio.ServicerContext
    ) -> trainer_pb2.TrainerStatus:
        return self._status()

    async def SaveCheckpoint(
        self, request: trainer_pb2.SaveCheckpointRequest, context: grpc.aio.ServicerContext
    ) -> trainer_pb2.SaveCheckpointResponse:
        if self.engine.config.checkpoint_dir is None:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION, "the trainer has no checkpoint_dir configured"
            )
        path = await self._call(context, self.engine.save_checkpoint)
        return trainer_pb2.SaveCheckpointResponse(path=str(path), step=self.engine.step_count)

    async def RunStage(
        self, request: trainer_pb2.RunStageRequest, context: grpc.aio.ServicerContext
    ) -> trainer_pb2.TrainerStatus:
        if self.stages is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "this trainer runs no stages: start it with --job and the "
                                "KILN_BUFFER_ADDR and KILN_WEIGHT_SYNC_ADDR addresses")
        try:
            self.stages.start(request.stage)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return self._status()

    async def final_checkpoint(self) -> Path | None:
        """Checkpoint unless the newest checkpoint already holds the current step (on shutdown)."""
        e = self.engine
        async with self._lock:
            if e.config.checkpoint_dir is None or e.step_count == 0:
                return None
            if e.last_checkpoint is not None and e.last_checkpoint.name == step_dir_name(e.step_count):
                return None
            return await asyncio.to_thread(self._locked, e.save_checkpoint)

    def _status(self) -> trainer_pb2.TrainerStatus:
        e = self.engine
        return trainer_pb2.TrainerStatus(
            step=e.step_count,
            policy_version=e.version,
            stage=e.stage or "",
            last_metrics=e.last_metrics,
            last_checkpoint=str(e.last_checkpoint or ""),
            tensor_parallel=e.config.tensor_parallel,
            model_dir=str(e.config.model_dir),
            **self._stage_fields(),
        )

    def _stage_fields(self) -> dict:
        if self.stages is None:
            return {}
        st = self.stages.status
        return {"stage_step": st.step, "stage_max_steps": st.max_steps, "stage_done": st.done,
                "stage_failed": st.failed, "message": st.message}


def add_to_server(servicer: TrainerServicer, server: grpc.aio.Server) -> None:
    trainer_pb2_grpc.add_TrainerServicer_to_server(servicer, server)
