"""Server interceptor: request ids, access logs and Prometheus RPC metrics for every method.

A caller may send `x-request-id` metadata; otherwise one is made up. The id is set in the logging
context for the duration of the call, so every log line the handler writes carries it, and it is
sent back in the trailing metadata so a client can quote it in a bug report.
"""
from __future__ import annotations

import logging
import time
import uuid
from typing import Any, Awaitable, Callable

import grpc

from kiln.logs import request_id_var
from kiln.services.common.metrics import RPC_SECONDS, RPC_TOTAL
from kiln.services.common.ratelimit import LogLimiter

log = logging.getLogger("kiln.rpc")
# A client looping on a failing call logs a few lines a minute, not one per call.
_FAILED_CALLS = LogLimiter(burst=5, period_s=60)


def _request_id(context: grpc.aio.ServicerContext) -> str:
    for key, value in context.invocation_metadata() or ():
        if key == "x-request-id":
            return value
    return uuid.uuid4().hex[:16]


class ObservabilityInterceptor(grpc.aio.ServerInterceptor):
    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or details.method.startswith("/grpc."):
            return handler  # health checks and reflection stay quiet
        method = details.method

        def wrap_unary(fn: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
            async def inner(request: Any, context: grpc.aio.ServicerContext) -> Any:
                token, start = _enter(context)
                try:
                    result = await fn(request, context)
                    return result
                finally:
                    _leave(context, method, token, start)
            return inner

        def wrap_stream(fn: Callable[..., Any]) -> Callable[..., Any]:
            async def inner(request: Any, context: grpc.aio.ServicerContext) -> Any:
                token, start = _enter(context)
                try:
                    async for item in fn(request, context):
                        yield item
                finally:
                    _leave(context, method, token, start)
            return inner

        return rewrap(handler, wrap_unary, wrap_stream)


def rewrap(handler: grpc.RpcMethodHandler, unary: Callable[[Any], Any],
           stream: Callable[[Any], Any]) -> grpc.RpcMethodHandler:
    """`handler` with its behaviour wrapped: `unary(fn)` for the kinds that return one reply,
    `stream(fn)` for those that stream replies (what a server interceptor hands back)."""
    kinds = (("unary_unary", unary, grpc.unary_unary_rpc_method_handler),
             ("stream_unary", unary, grpc.stream_unary_rpc_method_handler),
             ("unary_stream", stream, grpc.unary_stream_rpc_method_handler),
             ("stream_stream", stream, grpc.stream_stream_rpc_method_handler))
    for attr, wrap, make in kinds:
        fn = getattr(handler, attr)
        if fn:
            return make(wrap(fn), handler.request_deserializer, handler.response_serializer)
    return handler


def _enter(context: grpc.aio.ServicerContext) -> tuple[Any, float]:
    rid = _request_id(context)
    context.set_trailing_metadata((("x-request-id", rid),))
    return request_id_var.set(rid), time.perf_counter()


def _leave(context: grpc.aio.ServicerContext, method: str, token: Any, start: float) -> None:
    elapsed = time.perf_counter() - start
    code = context.code() or grpc.StatusCode.OK
    name = code.name if isinstance(code, grpc.StatusCode) else str(code)
    RPC_TOTAL.labels(method, name).inc()
    RPC_SECONDS.labels(method).observe(elapsed)
    # Successful calls are routine (DEBUG); RESOURCE_EXHAUSTED is the buffer's backpressure,
    # expected flow control (INFO); anything else deserves attention.
    level = {"OK": logging.DEBUG, "RESOURCE_EXHAUSTED": logging.INFO}.get(name, logging.WARNING)
    extra = {"fields": {"method": method, "code": name, "ms": round(elapsed * 1e3, 2)}}
    if level == logging.DEBUG:
        log.debug("%s %s %.1f ms", method, name, elapsed * 1e3, extra=extra)
    else:
        _FAILED_CALLS.log(log, level, (method, name), "%s %s %.1f ms", method, name,
                          elapsed * 1e3, extra=extra)
    request_id_var.reset(token)
