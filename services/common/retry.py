"""Retrying idempotent unary calls of a blocking gRPC stub on transient failures."""
from __future__ import annotations

import time
from typing import Any, Callable

import grpc

# ABORTED: a conflict with a concurrent change (weights swapped while scoring); the same call
# succeeds once it is over.
TRANSIENT = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                       grpc.StatusCode.ABORTED})


def call_with_retry(method: Callable[..., Any], request: Any, *, timeout: float,
                    attempts: int = 5, pause: float = 0.5) -> Any:
    """`method(request, timeout=timeout)`, tried up to `attempts` times while it fails with a
    transient status (the service restarting, a lost reply). Only for idempotent calls."""
    for attempt in range(attempts):
        try:
            return method(request, timeout=timeout)
        except grpc.RpcError as exc:
            if exc.code() not in TRANSIENT or attempt == attempts - 1:
                raise
            time.sleep(pause * (attempt + 1))
    raise AssertionError("unreachable")


async def call_until(method: Callable[..., Any], request: Any, *, timeout: float,
                     wait_s: float, pause: float = 0.5, max_pause: float = 5.0) -> Any:
    """`await method(request, timeout=timeout)` on an asyncio stub, retried while it fails with
    a transient status, until `wait_s` seconds have passed: for a peer that may still be
    starting (a frozen deployment whose checkpoint an earlier stage is yet to write). Only for
    idempotent calls, or ones whose repeat is harmless."""
    import asyncio

    loop = asyncio.get_running_loop()
    deadline, attempt = loop.time() + wait_s, 0
    while True:
        try:
            return await method(request, timeout=timeout)
        except grpc.aio.AioRpcError as exc:
            if exc.code() not in TRANSIENT or loop.time() > deadline:
                raise
            attempt += 1
            await asyncio.sleep(min(pause * attempt, max_pause))
