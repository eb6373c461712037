"""The buffer's client: the one way rollout, trainer, driver and tools talk to the buffer.

`BufferClient` is the protocol; it has two implementations:
- `GrpcBufferClient(target)`: a channel to a `kiln-buffer` process;
- `InProcessBufferClient(buffer)`: the same calls straight on a `TrajectoryBuffer`, so a whole
  RL loop can run in one process (tests, small local runs).
`make_client` picks one from a target string.

Calls are synchronous, for the trainer's stage thread and the driver, except `put_async`, the
Put of a producer running on an event loop (rollout), which also gives up once its
trajectories are no longer wanted (`still_wanted()` turned false: the stage they belong to is
over, and they must not land in the next stage's batches).

Retries. Put retries with exponential backoff and jitter on RESOURCE_EXHAUSTED (the buffer is
full) and the transient codes of `kiln.control.retry` (UNAVAILABLE: restarting, or a failed disk
write); it is idempotent by trajectory id, so a retry after a lost acknowledgement stores nothing
twice. The other calls retry on the transient codes only (AckBatch is idempotent, and a GetBatch whose answer was lost leaves
a lease that is served again). Other codes raise `grpc.RpcError` at once (INVALID_ARGUMENT will not heal).

The trainer's side of the lease protocol: `get_batch`, train, `ack_batch(batch.batch_id)`. A batch
whose ack did not arrive comes back with the same `batch_id` (and `delivery` > 1); a trainer that
remembers the ids it trained on acks such a batch again without training on it.

Not covered here: batching of puts (the caller decides how many trajectories per call; 0.5-1 MiB
messages move fastest, see PLATFORM.md).
"""
from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Awaitable, Callable, Protocol, Sequence, TypeVar

import grpc

from kiln.control import channels
from kiln.control.records import BufferStatus
from kiln.control import wire as control_wire
from kiln.control.retry import TRANSIENT
from kiln.protos.kiln.v1 import buffer_pb2, buffer_pb2_grpc
from kiln.services.buffer import wire
from kiln.services.buffer.buffer import TrajectoryBuffer
from kiln.services.buffer.leases import AckResult
from kiln.services.buffer.types import Batch, BufferConfig, BufferFull, PutResult
from kiln.services.common import codec
from kiln.trajectory import Trajectory

log = logging.getLogger("kiln.buffer.client")
T = TypeVar("T")

__all__ = ["AckResult", "Backoff", "Batch", "BufferClient", "BufferStatus", "GrpcBufferClient",
           "InProcessBufferClient", "PutResult", "make_client"]


class BufferClient(Protocol):
    def put(self, trajectories: Sequence[Trajectory], group_size: int | None = None) -> PutResult: ...

    async def put_async(self, trajectories: Sequence[Trajectory], group_size: int | None = None,
                        *, still_wanted: Callable[[], bool] = ...) -> PutResult | None:
        """The PutResult once stored; None if abandoned because `still_wanted()` turned false."""
        ...

    def get_batch(self, size: int, policy_version: int, timeout: float = 0.0,
                  allow_partial: bool = False) -> Batch: ...

    def ack_batch(self, batch_id: int) -> AckResult: ...

    def set_policy_version(self, version: int) -> BufferStatus: ...

    def configure(self, *, tau: int | None, group_size: int | None = None,
                  drop_unserved: bool = False) -> BufferStatus: ...

    def status(self) -> BufferStatus: ...

    def close(self) -> None: ...


@dataclass
class Backoff:
    """Exponential backoff with full jitter, given up after `max_wait` seconds in total."""

    initial: float = 0.05
    maximum: float = 2.0
    max_wait: float = 600.0

    def delays(self):
        """Pauses to sleep between attempts, until `max_wait` is used up."""
        deadline = time.monotonic() + self.max_wait
        delay = self.initial
        while (left := deadline - time.monotonic()) > 0:
            yield min(random.uniform(0, delay), left)
            delay = min(delay * 2, self.maximum)

    def run(self, fn: Callable[[], T], retryable: Callable[[BaseException], bool], what: str) -> T:
        pauses = self.delays()
        while True:
            try:
                return fn()
            except Exception as exc:
                if not retryable(exc):
                    raise
                pause = next(pauses, None)
                if pause is None:
                    log.error("%s: giving up after %.0f s: %s", what, self.max_wait, exc)
                    raise
                log.debug("%s: retrying in %.2f s: %s", what, pause, exc)
                time.sleep(pause)

    async def run_async(self, attempt: Callable[[], Awaitable[T]],
                        retryable: Callable[[BaseException], bool],
                        still_wanted: Callable[[], bool]) -> T | None:
        """`run` for a coroutine, given up (None) as soon as `still_wanted()` turns false.
        A failure that is not retryable (INVALID_ARGUMENT: a bug upstream) raises at once."""
        pauses = self.delays()
        while still_wanted():
            try:
                return await attempt()
            except Exception as exc:
                pause = next(pauses, None) if retryable(exc) else None
                if pause is None:
                    raise
            await asyncio.sleep(pause)
        return None


def _code(exc: BaseException) -> grpc.StatusCode | None:
    return exc.code() if isinstance(exc, grpc.RpcError) else None


def _put_retryable(exc: BaseException) -> bool:
    # Full is worth waiting out too: the trainer drains the buffer.
    return _code(exc) in TRANSIENT or _code(exc) == grpc.StatusCode.RESOURCE_EXHAUSTED


def _unavailable(exc: BaseException) -> bool:
    # A deadline passed is the network, not the request (a partition, a restart in the
    # middle): these calls are idempotent, so trying again is safe.
    return _code(exc) in TRANSIENT


def _put_request(trajectories: Sequence[Trajectory], group_size: int | None) -> buffer_pb2.PutRequest:
    req = buffer_pb2.PutRequest(group_size=group_size or 0)
    req.trajectories.extend(codec.to_bytes(t) for t in trajectories)
    return req


class GrpcBufferClient:
    def __init__(self, target: str, *, backoff: Backoff | None = None,
                 rpc_timeout: float = 60.0) -> None:
        self.target = target
        self.backoff = backoff or Backoff()
        self.rpc_timeout = rpc_timeout
        self._channel = channels.channel(target, "buffer")
        self._stub = buffer_pb2_grpc.BufferStub(self._channel)
        self._aio: grpc.aio.Channel | None = None

    def wait_ready(self, timeout: float) -> None:
        """Block until the channel connects (raises grpc.FutureTimeoutError otherwise)."""
        grpc.channel_ready_future(self._channel).result(timeout=timeout)

    def put(self, trajectories: Sequence[Trajectory], group_size: int | None = None) -> PutResult:
        req = _put_request(trajectories, group_size)
        resp = self.backoff.run(lambda: self._stub.Put(req, timeout=self.rpc_timeout),
                                _put_retryable, "buffer Put")
        return wire.put_result_from_proto(resp)

    async def put_async(self, trajectories: Sequence[Trajectory], group_size: int | None = None,
                        *, still_wanted: Callable[[], bool] = lambda: True) -> PutResult | None:
        if self._aio is None:
            # Created on first use, on the caller's event loop.
            self._aio = channels.aio_channel(self.target, "buffer")
        stub = buffer_pb2_grpc.BufferStub(self._aio)
        req = _put_request(trajectories, group_size)

        async def attempt() -> PutResult:
            return wire.put_result_from_proto(await stub.Put(req, timeout=self.rpc_timeout))

        return await self.backoff.run_async(attempt, _put_retryable, still_wanted)

    def get_batch(self, size: int, policy_version: int, timeout: float = 0.0,
                  allow_partial: bool = False) -> Batch:
        req = buffer_pb2.GetBatchRequest(size=size, policy_version=policy_version,
                                         timeout_seconds=timeout, allow_partial=allow_partial)
        # The server waits up to `timeout`; the deadline leaves room for the answer to arrive.
        resp = self.backoff.run(lambda: self._stub.GetBatch(req, timeout=timeout + self.rpc_timeout),
                                _unavailable, "buffer GetBatch")
        return wire.batch_from_proto(resp)

    def ack_batch(self, batch_id: int) -> AckResult:
        req = buffer_pb2.AckBatchRequest(batch_id=batch_id)
        return wire.ack_from_proto(self._call(self._stub.AckBatch, req, "AckBatch"))

    def set_policy_version(self, version: int) -> BufferStatus:
        req = buffer_pb2.SetPolicyVersionRequest(policy_version=version)
        return control_wire.buffer_status_from_proto(self._call(self._stub.SetPolicyVersion, req, "SetPolicyVersion"))

    def configure(self, *, tau: int | None, group_size: int | None = None,
                  drop_unserved: bool = False) -> BufferStatus:
        req = buffer_pb2.ConfigureRequest(group_size=group_size or 0, drop_unserved=drop_unserved)
        if tau is not None:
            req.tau = tau
        return control_wire.buffer_status_from_proto(self._call(self._stub.Configure, req, "Configure"))

    def status(self) -> BufferStatus:
        return control_wire.buffer_status_from_proto(
            self._call(self._stub.GetStatus, buffer_pb2.GetStatusRequest(), "GetStatus"))

    def _call(self, method: Callable[..., Any], req: Any, name: str) -> Any:
        return self.backoff.run(lambda: method(req, timeout=self.rpc_timeout), _unavailable,
                                f"buffer {name}")

    def close(self) -> None:
        self._channel.close()

    async def aclose(self) -> None:
        """Close the asyncio channel `put_async` opened (on its event loop), and the rest."""
        if self._aio is not None:
            await self._aio.close()
            self._aio = None
        self.close()


class InProcessBufferClient:
    """The buffer in this process. `configure(tau=None)` disables freshness, as over gRPC."""

    def __init__(self, buffer: TrajectoryBuffer, *, backoff: Backoff | None = None) -> None:
        self.buffer = buffer
        self.backoff = backoff or Backoff()

    def put(self, trajectories: Sequence[Trajectory], group_size: int | None = None) -> PutResult:
        return self.backoff.run(lambda: self.buffer.put(trajectories, group_size),
                                lambda e: isinstance(e, BufferFull), "buffer put")

    async def put_async(self, trajectories: Sequence[Trajectory], group_size: int | None = None,
                        *, still_wanted: Callable[[], bool] = lambda: True) -> PutResult | None:
        async def attempt() -> PutResult:
            return await asyncio.to_thread(self.buffer.put, trajectories, group_size)

        return await self.backoff.run_async(attempt, lambda e: isinstance(e, BufferFull),
                                            still_wanted)

    def get_batch(self, size: int, policy_version: int, timeout: float = 0.0,
                  allow_partial: bool = False) -> Batch:
        return self.buffer.get_batch(size, policy_version, timeout, allow_partial)

    def ack_batch(self, batch_id: int) -> AckResult:
        return self.buffer.ack_batch(batch_id)

    def set_policy_version(self, version: int) -> BufferStatus:
        return self.buffer.set_policy_version(version)

    def configure(self, *, tau: int | None, group_size: int | None = None,
                  drop_unserved: bool = False) -> BufferStatus:
        return self.buffer.configure(tau=tau, group_size=group_size, drop_unserved=drop_unserved)

    def status(self) -> BufferStatus:
        return self.buffer.status()

    def close(self) -> None:
        self.buffer.close()

    async def aclose(self) -> None:
        self.close()


def make_client(target: str, config: BufferConfig | None = None) -> BufferClient:
    """`local:DIR` opens a buffer in this process on DIR; anything else is a gRPC target."""
    if target.startswith("local:"):
        return InProcessBufferClient(TrajectoryBuffer.open(Path(target[len("local:"):]), config))
    return GrpcBufferClient(target)
