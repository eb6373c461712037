"""Shipping finished trajectories to the buffer, without blocking the event loop.

The buffer answers RESOURCE_EXHAUSTED when it is full (backpressure) and UNAVAILABLE while it
restarts; both are retried with backoff, since a Put is idempotent by trajectory id. A put is
abandoned, not retried forever, once its trajectories are no longer wanted (the stage they
belong to is over): they must not land in the next stage's batches.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Callable

import grpc

from kiln.protos.kiln.v1 import buffer_pb2, buffer_pb2_grpc
from kiln.services.common.codec import to_proto
from kiln.trajectory import Trajectory

log = logging.getLogger(__name__)

_RETRY = {grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE,
          grpc.StatusCode.DEADLINE_EXCEEDED}


class BufferSink:
    def __init__(self, channel: grpc.aio.Channel, *, timeout: float = 30.0,
                 max_backoff: float = 2.0) -> None:
        self.stub = buffer_pb2_grpc.BufferStub(channel)
        self.timeout, self.max_backoff = timeout, max_backoff

    async def put(self, trajectories: list[Trajectory], *,
                  still_wanted: Callable[[], bool] = lambda: True) -> bool:
        """True once the buffer acknowledged the group; False if it stopped being wanted."""
        req = buffer_pb2.PutRequest(trajectories=[to_proto(t) for t in trajectories],
                                    group_size=len(trajectories))
        delay = 0.05
        while still_wanted():
            try:
                await self.stub.Put(req, timeout=self.timeout)
                return True
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in _RETRY:
                    # INVALID_ARGUMENT and the like: a bug upstream; retrying cannot help.
                    raise
            await asyncio.sleep(delay)
            delay = min(self.max_backoff, delay * 2)
        return False
