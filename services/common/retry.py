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
