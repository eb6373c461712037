"""Retrying transient gRPC failures: the asyncio helper frozen deployments' callers use."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from kiln.control.retry import call_until


def _error(code: grpc.StatusCode) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details="test")


class Flaky:
    """An async unary method that fails with `codes` in turn, then answers."""

    def __init__(self, *codes: grpc.StatusCode) -> None:
        self.codes = list(codes)
        self.calls: list[tuple[str, float]] = []

    async def __call__(self, request, *, timeout):
        self.calls.append((request, timeout))
        if self.codes:
            raise _error(self.codes.pop(0))
        return f"answer to {request}"


def test_transient_failures_are_retried_until_an_answer():
    method = Flaky(grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED,
                   grpc.StatusCode.DEADLINE_EXCEEDED)
    got = asyncio.run(call_until(method, "req", timeout=7, wait_s=60, pause=0.001))
    assert got == "answer to req"
    assert method.calls == [("req", 7)] * 4


def test_a_permanent_failure_is_raised_at_once():
    method = Flaky(grpc.StatusCode.INVALID_ARGUMENT)
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        asyncio.run(call_until(method, "req", timeout=7, wait_s=60, pause=0.001))
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert len(method.calls) == 1


def test_transient_failures_past_the_wait_are_raised():
    method = Flaky(*[grpc.StatusCode.UNAVAILABLE] * 1000)
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        asyncio.run(call_until(method, "req", timeout=7, wait_s=0.05, pause=0.01, max_pause=0.01))
    assert exc.value.code() == grpc.StatusCode.UNAVAILABLE
    # About 0.05 s of 0.01 s pauses: more than one try, far fewer than the 1000 failures queued.
    assert 2 <= len(method.calls) < 100
