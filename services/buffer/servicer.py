"""The `kiln.v1.Buffer` gRPC servicer: protobuf <-> domain translation and status codes only.

Every call that touches the disk (Put's fsync, a lease or ack record) runs in a worker thread, so
the event loop keeps answering health checks and other calls meanwhile. A waiting GetBatch does
not hold a thread: it waits on an asyncio event that the buffer's listener sets after each Put
and ack, or until the next lease falls due, and re-checks.

Status codes: INVALID_ARGUMENT for a record or request that will never be accepted (do not
retry), RESOURCE_EXHAUSTED when the buffer is full (retry with backoff), UNAVAILABLE when the disk
write failed (retry; the Put was not stored). The logic is in buffer.py.
"""
from __future__ import annotations

import asyncio
import logging
import time

import grpc

from kiln.protos.kiln.v1 import buffer_pb2, buffer_pb2_grpc
from kiln.services.buffer.buffer import (
    AckResult,
    Batch,
    BufferFull,
    BufferStatus,
    InvalidTrajectory,
    TrajectoryBuffer,
)
from kiln.services.buffer.leases import AckStatus
from kiln.services.common import codec

log = logging.getLogger("kiln.buffer.rpc")


def status_to_proto(s: BufferStatus) -> buffer_pb2.BufferStatus:
    msg = buffer_pb2.BufferStatus(
        depth=s.depth, ready=s.ready, groups_pending=s.groups_pending, groups_ready=s.groups_ready,
        accepted=s.accepted, served=s.served, dropped_stale=s.dropped_stale,
        dropped_other=s.dropped_other, batches=s.batches, max_staleness=s.max_staleness,
        trainer_version=s.trainer_version, capacity=s.capacity, group_size=s.group_size,
        leased=s.leased, leases=s.leases, batches_acked=s.batches_acked,
        redeliveries=s.redeliveries, lease_timeout=s.lease_timeout)
    if s.tau is not None:
        msg.tau = s.tau
    return msg


def status_from_proto(msg: buffer_pb2.BufferStatus) -> BufferStatus:
    return BufferStatus(
        depth=msg.depth, ready=msg.ready, groups_pending=msg.groups_pending,
        groups_ready=msg.groups_ready, accepted=msg.accepted, served=msg.served,
        dropped_stale=msg.dropped_stale, dropped_other=msg.dropped_other, batches=msg.batches,
        max_staleness=msg.max_staleness, trainer_version=msg.trainer_version,
        capacity=msg.capacity, group_size=msg.group_size,
        tau=msg.tau if msg.HasField("tau") else None, leased=msg.leased, leases=msg.leases,
        batches_acked=msg.batches_acked, redeliveries=msg.redeliveries,
        lease_timeout=msg.lease_timeout)


def batch_to_proto(b: Batch) -> buffer_pb2.Batch:
    msg = buffer_pb2.Batch(batch_id=b.batch_id, trainer_version=b.trainer_version,
                           delivery=b.delivery)
    msg.trajectories.extend(codec.to_proto(t) for t in b.trajectories)
    msg.staleness.extend(b.staleness)
    return msg


def batch_from_proto(msg: buffer_pb2.Batch) -> Batch:
    return Batch([codec.from_proto(t) for t in msg.trajectories], msg.batch_id,
                 msg.trainer_version, list(msg.staleness), msg.delivery)


def ack_to_proto(r: AckResult) -> buffer_pb2.AckBatchResponse:
    return buffer_pb2.AckBatchResponse(status=r.status.value, trajectories=r.trajectories,
                                       detail=r.detail)


def ack_from_proto(msg: buffer_pb2.AckBatchResponse) -> AckResult:
    return AckResult(AckStatus(msg.status), msg.trajectories, msg.detail)


class BufferServicer(buffer_pb2_grpc.BufferServicer):
    def __init__(self, buffer: TrajectoryBuffer) -> None:
        self.buffer = buffer
        self._loop: asyncio.AbstractEventLoop | None = None
        self._changed: asyncio.Event | None = None
        buffer.add_listener(self._on_change)

    def _event(self) -> asyncio.Event:
        if self._changed is None:
            self._loop = asyncio.get_running_loop()
            self._changed = asyncio.Event()
        return self._changed

    def _on_change(self) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._wake)

    def _wake(self) -> None:
        # Waiters hold the old event; a fresh one is armed for the next change.
        if self._changed is not None:
            old, self._changed = self._changed, asyncio.Event()
            old.set()

    async def Put(self, request: buffer_pb2.PutRequest,
                  context: grpc.aio.ServicerContext) -> buffer_pb2.PutResponse:
        self._event()
        trajectories = [codec.from_proto(m) for m in request.trajectories]
        try:
            r = await asyncio.to_thread(self.buffer.put, trajectories, request.group_size or None)
        except InvalidTrajectory as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except BufferFull as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except OSError as exc:
            log.error("buffer write failed: %s", exc)
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"buffer write failed, not stored: {exc}")
        return buffer_pb2.PutResponse(accepted=r.accepted, duplicates=r.duplicates,
                                      dropped_stale=r.dropped_stale, depth=r.depth)

    async def GetBatch(self, request: buffer_pb2.GetBatchRequest,
                       context: grpc.aio.ServicerContext) -> buffer_pb2.Batch:
        deadline = time.monotonic() + max(0.0, request.timeout_seconds)
        try:
            while True:
                changed = self._event()  # armed before looking, so no Put is missed
                batch, due_in = await asyncio.to_thread(
                    self.buffer.poll_batch, request.size, request.trainer_version, False)
                remaining = deadline - time.monotonic()
                if batch.trajectories or remaining <= 0:
                    break
                if due_in is not None:
                    remaining = min(remaining, due_in + 0.001)
                try:
                    await asyncio.wait_for(changed.wait(), remaining)
                except asyncio.TimeoutError:
                    pass
            if not batch.trajectories and request.allow_partial:
                batch = await asyncio.to_thread(
                    self.buffer.try_get_batch, request.size, request.trainer_version, True)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except OSError as exc:
            log.error("buffer write failed: %s", exc)
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"buffer write failed: {exc}")
        return batch_to_proto(batch)

    async def AckBatch(self, request: buffer_pb2.AckBatchRequest,
                       context: grpc.aio.ServicerContext) -> buffer_pb2.AckBatchResponse:
        self._event()
        try:
            r = await asyncio.to_thread(self.buffer.ack_batch, request.batch_id)
        except OSError as exc:
            log.error("buffer write failed: %s", exc)
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                f"buffer write failed, batch not acked: {exc}")
        return ack_to_proto(r)

    async def SetTrainerVersion(self, request: buffer_pb2.SetTrainerVersionRequest,
                                context: grpc.aio.ServicerContext) -> buffer_pb2.BufferStatus:
        s = await asyncio.to_thread(self.buffer.set_trainer_version, request.version)
        return status_to_proto(s)

    async def Configure(self, request: buffer_pb2.ConfigureRequest,
                        context: grpc.aio.ServicerContext) -> buffer_pb2.BufferStatus:
        tau = request.tau if request.HasField("tau") else None
        try:
            s = await asyncio.to_thread(self.buffer.configure, request.group_size or None, tau,
                                        request.drop_unserved)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        self._on_change()
        return status_to_proto(s)

    async def GetStatus(self, request: buffer_pb2.GetStatusRequest,
                        context: grpc.aio.ServicerContext) -> buffer_pb2.BufferStatus:
        return status_to_proto(self.buffer.status())

    async def close(self) -> None:
        self.buffer.remove_listener(self._on_change)
        await asyncio.to_thread(self.buffer.close)
