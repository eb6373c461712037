"""One convention, for every gRPC client in Kiln, for a peer that fails to answer.

Transient (worth asking again): UNAVAILABLE (the peer restarting or not scheduled yet, a lost
connection), DEADLINE_EXCEEDED (a lost reply) and ABORTED (a conflict with a concurrent change,
such as weights swapped while scoring; the same call succeeds once it is over). Everything else
will not heal by asking again.

- `call_with_retry`: an idempotent call, tried a few times while it fails transiently.
- `call_until`: the same on an asyncio stub, for a peer that may still be starting (a frozen
  deployment whose checkpoint an earlier stage is yet to write): retried for up to `wait_s`.
- `control_call`: what the control clients (`kiln.control.clients`) make of a failure. One that
  waiting may heal raises `ServiceUnavailable`, which a stage driver waits out (its
  `transient`) while the service is restarted; anything else raises `ServiceError`, which fails
  the run with the service's own message. Both are `grpc.RpcError`s (with `code()` and
  `details()`), so callers that catch those need not know the difference.
"""
from __future__ import annotations

import time
from typing import Any, Callable

import grpc

TRANSIENT = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                       grpc.StatusCode.ABORTED})
# A service answers health checks while it builds and UNIMPLEMENTED for the rest (and a pod
# being replaced may briefly be an older one): for a control call, as good as unavailable.
_STARTING = grpc.StatusCode.UNIMPLEMENTED


class ControlError(grpc.RpcError):
    """A control call that failed; `what` names the service and method."""

    def __init__(self, what: str, code: grpc.StatusCode, details: str = "") -> None:
        super().__init__(f"{what}: {code.name}" + (f": {details}" if details else ""))
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class ServiceUnavailable(ControlError):
    """The service did not answer (restarting, not scheduled yet, still loading its model):
    recoverable by waiting for it."""


class ServiceError(ControlError, RuntimeError):
    """The service answered with an error that asking again will not fix (a bad request, a
    failed stage): not recoverable by retrying."""


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
    a transient status, until `wait_s` seconds have passed. Only for idempotent calls, or ones
    whose repeat is harmless."""
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


def control_call(method: Callable[..., Any], request: Any, *, timeout: float, what: str,
                 retry: bool = True) -> Any:
    """A control call: retried on transient failures when `retry` (idempotent calls only),
    then failing with `ServiceUnavailable` or `ServiceError` (see the module's doc)."""
    try:
        if retry:
            return call_with_retry(method, request, timeout=timeout)
        return method(request, timeout=timeout)
    except ControlError:
        raise
    except grpc.RpcError as exc:
        code = exc.code()
        if code in TRANSIENT or code == _STARTING:
            raise ServiceUnavailable(what, code, exc.details() or "") from exc
        raise ServiceError(what, code, exc.details() or "") from exc
