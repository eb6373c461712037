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
import errno
import logging
import time

import grpc

from kiln.control import wire as control_wire
from kiln.protos.kiln.v1 import buffer_pb2, buffer_pb2_grpc
from kiln.services.buffer import wire
from kiln.services.buffer.buffer import TrajectoryBuffer
from kiln.services.buffer.types import BufferFull, InvalidTrajectory
from kiln.services.common import metrics
from kiln.services.common.ratelimit import LogLimiter

log = logging.getLogger("kiln.buffer.rpc")
_WRITE_ERRORS = LogLimiter(burst=5, period_s=60)


def _write_failed(exc: OSError) -> None:
    """Count (by errno) and log, a few lines a minute, a write the buffer could not make: a
    full disk fails every Put until space is freed, and the alert reads the counter."""
    name = errno.errorcode.get(exc.errno or 0, "other")
    metrics.BUFFER_WRITE_ERRORS.labels(name).inc()
    _WRITE_ERRORS.log(log, logging.ERROR, name, "buffer write failed: %s", exc)


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
        try:
            # The serialized trajectories go to the buffer as they arrived (it decodes each
            # once to check it and stores these bytes).
            r = await asyncio.to_thread(self.buffer.put, list(request.trajectories),
                                        request.group_size or None)
        except InvalidTrajectory as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except BufferFull as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except OSError as exc:
            _write_failed(exc)
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"buffer write failed, not stored: {exc}")
        return wire.put_result_to_proto(r)

    async def GetBatch(self, request: buffer_pb2.GetBatchRequest,
                       context: grpc.aio.ServicerContext) -> buffer_pb2.Batch:
        deadline = time.monotonic() + max(0.0, request.timeout_seconds)
        try:
            while True:
                changed = self._event()  # armed before looking, so no Put is missed
                batch, due_in = await asyncio.to_thread(
                    self.buffer.poll_batch, request.size, request.policy_version, False)
                remaining = deadline - time.monotonic()
                if batch.payloads or remaining <= 0:
                    break
                if due_in is not None:
                    remaining = min(remaining, due_in + 0.001)
                try:
                    await asyncio.wait_for(changed.wait(), remaining)
                except asyncio.TimeoutError:
                    pass
            if not batch.payloads and request.allow_partial:
                batch = await asyncio.to_thread(
                    self.buffer.try_get_batch, request.size, request.policy_version, True)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except OSError as exc:
            _write_failed(exc)
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"buffer write failed: {exc}")
        return wire.batch_to_proto(batch)

    async def AckBatch(self, request: buffer_pb2.AckBatchRequest,
                       context: grpc.aio.ServicerContext) -> buffer_pb2.AckBatchResponse:
        self._event()
        try:
            r = await asyncio.to_thread(self.buffer.ack_batch, request.batch_id)
        except OSError as exc:
            _write_failed(exc)
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                f"buffer write failed, batch not acked: {exc}")
        return wire.ack_to_proto(r)

    async def SetPolicyVersion(self, request: buffer_pb2.SetPolicyVersionRequest,
                               context: grpc.aio.ServicerContext) -> buffer_pb2.BufferStatus:
        s = await asyncio.to_thread(self.buffer.set_policy_version, request.policy_version)
        return control_wire.buffer_status_to_proto(s)

    async def Configure(self, request: buffer_pb2.ConfigureRequest,
                        context: grpc.aio.ServicerContext) -> buffer_pb2.BufferStatus:
        tau = request.tau if request.HasField("tau") else None
        try:
            s = await asyncio.to_thread(self.buffer.configure, tau=tau,
                                        group_size=request.group_size or None,
                                        drop_unserved=request.drop_unserved)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        self._on_change()
        return control_wire.buffer_status_to_proto(s)

    async def GetStatus(self, request: buffer_pb2.GetStatusRequest,
                        context: grpc.aio.ServicerContext) -> buffer_pb2.BufferStatus:
        return control_wire.buffer_status_to_proto(self.buffer.status())

    async def close(self) -> None:
        self.buffer.remove_listener(self._on_change)
        await asyncio.to_thread(self.buffer.close)
