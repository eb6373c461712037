"""gRPC servicer of `kiln.v1.Trainer`: RunStage, GetTrainerStatus and the guard rails'
ContinueStage and RestoreCheckpoint around the stage runner, and FetchStageExport, which hands a finished stage's final weights to the job's frozen
deployments (on a cluster they cannot mount the trainer's volume).

Training itself happens in the stage runner's thread (`stages.py`), which pulls batches from
the buffer; these calls only start a stage and report. Errors: INVALID_ARGUMENT for an unknown
stage or one that cannot start while another runs; FAILED_PRECONDITION for a trainer started
without a job or without the buffer and weight-sync addresses, and for a stage not exported yet.
"""
from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import grpc

from kiln.control import wire as control_wire
from kiln.control.records import TrainerStatus
from kiln.protos.kiln.v1 import trainer_pb2, trainer_pb2_grpc
from kiln.services.trainer import wire
from kiln.services.trainer.checkpoint import step_dir_name
from kiln.services.trainer.engine import TrainerEngine
from kiln.services.trainer.stages import StageRunner, stage_export_dir

SERVICE_NAME = "kiln.v1.Trainer"


class TrainerServicer(trainer_pb2_grpc.TrainerServicer):
    def __init__(self, engine: TrainerEngine, engine_lock: threading.Lock | None = None,
                 stages: StageRunner | None = None) -> None:
        self.engine = engine
        # Shared with the stage runner's thread, which steps the same engine.
        self.engine_lock = engine_lock or threading.Lock()
        self.stages = stages

    async def RunStage(self, request: trainer_pb2.RunStageRequest,
                       context: grpc.aio.ServicerContext) -> trainer_pb2.TrainerStatus:
        if self.stages is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "this trainer runs no stages: start it with --job and the "
                                "KILN_BUFFER_ADDR and KILN_WEIGHT_SYNC_ADDR addresses")
        try:
            self.stages.start(request.stage)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return control_wire.trainer_status_to_proto(self.status())

    async def ContinueStage(self, request: trainer_pb2.ContinueStageRequest,
                            context: grpc.aio.ServicerContext) -> trainer_pb2.TrainerStatus:
        await self._guarded(context, self.stages.continue_stage, request.stage, request.step,
                            request.keep_step)
        return control_wire.trainer_status_to_proto(self.status())

    async def RestoreCheckpoint(self, request: trainer_pb2.RestoreCheckpointRequest,
                                context: grpc.aio.ServicerContext) -> trainer_pb2.TrainerStatus:
        await self._guarded(context, self.stages.restore, request.stage, request.step,
                            request.reason)
        return control_wire.trainer_status_to_proto(self.status())

    async def _guarded(self, context: grpc.aio.ServicerContext, call, *args) -> None:
        """A guard-rail call in a worker thread (a restore loads and exports a model)."""
        if self.stages is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this trainer runs no stages")
        try:
            await asyncio.to_thread(call, *args)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except TimeoutError as exc:  # the stage did not stop in time: a retry may find it stopped
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))

    async def RecordScalars(self, request: trainer_pb2.RecordScalarsRequest,
                            context: grpc.aio.ServicerContext) -> trainer_pb2.RecordScalarsReply:
        if self.stages is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "this trainer runs no stages, so it keeps no job scalars")
        # A thread: after an evaluation the files are copied to the output location.
        await asyncio.to_thread(self.stages.driver_scalars.record, request.step,
                                dict(request.scalars))
        return trainer_pb2.RecordScalarsReply()

    async def GetTrainerStatus(self, request: trainer_pb2.TrainerStatusRequest,
                               context: grpc.aio.ServicerContext) -> trainer_pb2.TrainerStatus:
        return control_wire.trainer_status_to_proto(self.status())

    async def FetchStageExport(self, request: trainer_pb2.FetchStageExportRequest,
                               context: grpc.aio.ServicerContext):
        if self.stages is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "this trainer runs no stages, so it has no stage exports")
        if not any(s.name == request.stage for s in self.stages.job.spec.stages):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"stage {request.stage!r} is not a stage of this job")
        folder = stage_export_dir(self.stages.run_dir, request.stage)
        # The export is renamed into place whole (`write_hf_dir`): its config.json means done.
        if not (folder / "config.json").exists():
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"stage {request.stage!r} has not finished yet; its weights are "
                                "exported when it does")
        try:
            chunks = wire.export_chunks(folder)
            while (chunk := await asyncio.to_thread(next, chunks, None)) is not None:
                yield chunk
        except FileNotFoundError as exc:
            # The folder was replaced between listing and opening it (exported again).
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                f"stage {request.stage!r}'s export is being rewritten ({exc}); retry")

    def status(self) -> TrainerStatus:
        e = self.engine
        out = TrainerStatus(
            step=e.step_count, policy_version=e.policy_version, stage=e.stage or "",
            last_step=e.last_step, last_checkpoint=str(e.last_checkpoint or ""),
            tensor_parallel=e.config.tensor_parallel, model_dir=str(e.config.model_dir))
        if self.stages is not None:
            st = self.stages.status
            out.stage_step, out.stage_max_steps = st.step, st.max_steps
            out.stage_done, out.stage_failed, out.message = st.done, st.failed, st.message
            out.stage_eval_step = st.eval_step
            out.stage_selected_step, out.stage_selected_reason = st.selected_step, st.selected_reason
        return out

    async def final_checkpoint(self) -> Path | None:
        """Checkpoint unless the newest checkpoint already holds the current step (on shutdown)."""
        e = self.engine
        if e.config.checkpoint_dir is None or e.step_count == 0:
            return None
        if e.last_checkpoint is not None and e.last_checkpoint.name == step_dir_name(e.step_count):
            return None

        def save() -> Path:
            with self.engine_lock:
                return e.save_checkpoint()

        return await asyncio.to_thread(save)


def add_to_server(servicer: TrainerServicer, server: grpc.aio.Server) -> None:
    trainer_pb2_grpc.add_TrainerServicer_to_server(servicer, server)
