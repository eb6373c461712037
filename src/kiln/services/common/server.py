"""The gRPC server every Kiln service runs in: health, reflection, interceptors, metrics, SIGTERM.

A service module builds its servicers and calls `run_service(...)` from its `main()`:

    async def build(job, args):            # may take long: load a model, open a store...
        svc = BufferServicer(...)
        return [Registration(add_BufferServicer_to_server, svc, "kiln.v1.Buffer")], svc.close

    def main():
        run_service("buffer", build)

Readiness is real: the standard health service answers NOT_SERVING while `build` runs and
SERVING once it has returned, so a launcher (or a kubelet's gRPC probe) knows when to send work.
On SIGTERM or SIGINT the health status turns NOT_SERVING, in-flight RPCs get `grace` seconds,
and the service's `on_stop` hook runs (a trainer writes its checkpoint there).

Tests use `create_server("127.0.0.1:0", registrations)`, which returns `(server, port)`.

Every server is bounded (`ServerLimits`): RPCs in flight at once (beyond them a call gets
RESOURCE_EXHAUSTED at once, instead of each one holding up to a message of memory), the
size of one received message (a service whose requests are small says so), and the number
of open Health.Watch streams (each one holds a task and a condition until the client leaves).
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable, Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import start_http_server

from kiln.api.spec import RLJob
from kiln.api.validate import ManifestError, load_job
from kiln.control.channels import CHANNEL_OPTIONS, MAX_MESSAGE_BYTES
from kiln.files import write_json_whole
from kiln.services.common import metrics
from kiln.services.common.interceptors import ObservabilityInterceptor
from kiln.logs import adopt_library_loggers, setup_logging
from kiln.services.common.tls import INSECURE_ENV, AuthorizationInterceptor, server_credentials
from kiln.tls import TLS_DIR_ENV, Bundle, own_bundle

log = logging.getLogger("kiln.server")

UP = metrics.SERVICE_UP


@dataclass(frozen=True)
class ServerLimits:
    """What one client, or many, can make a server hold."""

    max_concurrent_rpcs: int = 4096
    """RPCs in flight at once, streams included (a rollout's episodes, subscribers)."""
    max_receive_bytes: int = MAX_MESSAGE_BYTES
    """Largest request message; services with small requests lower it."""
    max_health_watchers: int = 64
    """Open Health.Watch streams (probes use Check; a watcher is a peer waiting for ready)."""


#: The plain-text health endpoint for Kubernetes' probes: Check and Watch only, tiny requests.
PROBE_LIMITS = ServerLimits(max_concurrent_rpcs=64, max_receive_bytes=64 << 10)


class BoundedHealth(health.aio.HealthServicer):
    """The standard health service with at most `max_watchers` open Watch streams; one more
    gets RESOURCE_EXHAUSTED (retry after another closes)."""

    def __init__(self, max_watchers: int) -> None:
        super().__init__()
        self.max_watchers = max_watchers
        self.watchers = 0

    async def Watch(self, request, context) -> None:
        if self.watchers >= self.max_watchers:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"{self.watchers} Health.Watch streams are open (the limit); "
                                "use Check, or retry later")
        self.watchers += 1
        try:
            await super().Watch(request, context)
        finally:
            self.watchers -= 1


def _grpc_server(interceptors: list, limits: ServerLimits) -> grpc.aio.Server:
    options = [(k, v) for k, v in CHANNEL_OPTIONS if k != "grpc.max_receive_message_length"]
    return grpc.aio.server(interceptors=interceptors, maximum_concurrent_rpcs=limits.max_concurrent_rpcs,
                           options=[*options, ("grpc.max_receive_message_length",
                                               limits.max_receive_bytes)])


@dataclass
class Registration:
    """One servicer to add: the generated `add_XServicer_to_server`, the instance, its full name."""

    add: Callable[[Any, grpc.aio.Server], None]
    servicer: Any
    name: str


async def _starting(_requests: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
    await context.abort(grpc.StatusCode.UNAVAILABLE,
                        "the service is starting (its health says NOT_SERVING); retry")
    yield b""  # never reached: a response stream is an async generator


# A stream-stream handler fits any call: it aborts before reading or writing a message.
_STARTING = grpc.stream_stream_rpc_method_handler(_starting)


class _LateHandlers(grpc.GenericRpcHandler):
    """Servicers added after the server has started (grpc.aio cannot add them later itself).

    Generated `add_XServicer_to_server(servicer, server)` functions are pointed at this object
    instead of the server; it records their handlers and serves them from then on. Until the
    service is ready, a call to one of Kiln's methods gets UNAVAILABLE, the status clients
    retry, rather than UNIMPLEMENTED: a frozen deployment still loading its checkpoint is a
    peer to wait for, not one without the method.
    """

    def __init__(self) -> None:
        self._handlers: list[grpc.GenericRpcHandler] = []
        self.starting = True

    def add_generic_rpc_handlers(self, handlers: Sequence[grpc.GenericRpcHandler]) -> None:
        self._handlers.extend(handlers)

    def add_registered_method_handlers(self, service: str, handlers: dict) -> None:
        pass  # the generic handler added alongside covers the same methods

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        for h in self._handlers:
            found = h.service(details)
            if found is not None:
                return found
        if self.starting and details.method.startswith("/kiln."):
            return _STARTING
        return None


@dataclass
class Served:
    server: grpc.aio.Server
    port: int
    health: health.aio.HealthServicer
    late: _LateHandlers
    names: list[str]

    async def register(self, registrations: Sequence[Registration], ready: bool = True) -> None:
        """Add servicers to the running server and, by default, report them SERVING."""
        for reg in registrations:
            reg.add(reg.servicer, self.late)
            self.names.append(reg.name)
        self.late.starting = not ready
        await set_serving(self.health, self.names, ready)


async def start_server(address: str, registrations: Sequence[Registration] = (), *,
                       ready: bool = True, tls: Bundle | None = None,
                       limits: ServerLimits = ServerLimits()) -> Served:
    """Serve on `address`: mutual TLS with `tls` (each RPC authorized by the caller's
    component), plain text without it."""
    interceptors: list[grpc.aio.ServerInterceptor] = [ObservabilityInterceptor()]
    if tls is not None:
        interceptors.append(AuthorizationInterceptor())
    server = _grpc_server(interceptors, limits)
    health_servicer = BoundedHealth(limits.max_health_watchers)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    late = _LateHandlers()
    server.add_generic_rpc_handlers((late,))
    # Reflection lists services known at start; late ones are discoverable by name via health.
    reflection.enable_server_reflection(
        [r.name for r in registrations]
        + [health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME],
        server,
    )
    port = (server.add_secure_port(address, server_credentials(tls)) if tls is not None
            else server.add_insecure_port(address))
    if port == 0:
        raise OSError(f"could not bind gRPC server to {address}")
    await server.start()
    served = Served(server, port, health_servicer, late, [])
    await served.register(registrations, ready)
    return served


async def create_server(address: str, registrations: Sequence[Registration] = (), *,
                        ready: bool = True, tls: Bundle | None = None,
                        limits: ServerLimits = ServerLimits()) -> tuple[grpc.aio.Server, int]:
    """Build and start a server bound to `address` ("127.0.0.1:0" picks a free port)."""
    served = await start_server(address, registrations, ready=ready, tls=tls, limits=limits)
    return served.server, served.port


async def set_serving(health_servicer: health.aio.HealthServicer, names: Sequence[str], ok: bool) -> None:
    status = (health_pb2.HealthCheckResponse.SERVING if ok
              else health_pb2.HealthCheckResponse.NOT_SERVING)
    for name in ["", *names]:
        await health_servicer.set(name, status)


BuildFn = Callable[[RLJob | None, argparse.Namespace],
                   Awaitable[tuple[list[Registration], Callable[[], Awaitable[None]] | None]]]


def service_argparser(service: str) -> argparse.ArgumentParser:
    """The flags every service process takes; a service may add its own before `run_service`."""
    p = argparse.ArgumentParser(prog=f"kiln-{service}", description=f"Kiln {service} service")
    p.add_argument("--job", type=Path, help="RLJob manifest (the operator mounts it from a ConfigMap)")
    p.add_argument("--address", default="0.0.0.0:50051", help="gRPC listen address (port 0: any free)")
    p.add_argument("--metrics-port", type=int, default=9090, help="Prometheus /metrics port (0: any free)")
    p.add_argument("--run-dir", type=Path, default=Path("."), help="directory for state and checkpoints")
    p.add_argument("--port-file", type=Path, help="write the bound gRPC and metrics ports here (JSON)")
    p.add_argument("--grace", type=float, default=10.0, help="seconds in-flight RPCs get on SIGTERM")
    p.add_argument("--tls-dir", type=Path,
                   help=f"this component's certificate folder: ca.crt, tls.crt, tls.key (default ${TLS_DIR_ENV})")
    p.add_argument("--insecure", action="store_true",
                   help=f"serve plain-text gRPC without a certificate folder (debugging only; or {INSECURE_ENV}=1)")
    p.add_argument("--health-address",
                   help="also answer plain-text health checks, and nothing else, here (Kubernetes' gRPC probes "
                        "cannot speak TLS)")
    return p


def metrics_host(address: str) -> str:
    """Where /metrics listens: the host gRPC serves on (loopback stays loopback); loopback for
    a Unix socket."""
    if address.startswith("unix:"):
        return "127.0.0.1"
    return address.rsplit(":", 1)[0].strip("[]") or "0.0.0.0"


def _tls(service: str, args: argparse.Namespace) -> tuple[Bundle | None, str | None]:
    """(certificate bundle or None for plain text, an error to exit with)."""
    try:
        bundle = own_bundle(args.tls_dir)
    except ValueError as exc:
        return None, str(exc)
    if bundle is not None:
        # This process's own clients (the trainer's to the buffer, ...) use the same certificate.
        os.environ[TLS_DIR_ENV] = str(args.tls_dir or os.environ[TLS_DIR_ENV])
        return bundle, None
    if args.insecure or os.environ.get(INSECURE_ENV) == "1":
        # This process's own clients then connect in plain text too (`kiln.control.channels`).
        os.environ[INSECURE_ENV] = "1"
        return None, None
    return None, (f"no certificate folder: give --tls-dir DIR (ca.crt, tls.crt, tls.key) or "
                  f"${TLS_DIR_ENV}; --insecure serves plain text (debugging only)")


def run_service(service: str, build: BuildFn, argv: Sequence[str] | None = None,
                parser: argparse.ArgumentParser | None = None,
                limits: ServerLimits = ServerLimits()) -> int:
    """Parse flags, load the job, serve until SIGTERM/SIGINT. Returns the process exit code."""
    parser = parser or service_argparser(service)
    args = parser.parse_args(argv)
    setup_logging(service, relay=True)
    job = None
    if args.job is not None:
        try:
            job = load_job(args.job)
        except ManifestError as exc:
            # A bad manifest will not fix itself on restart; say exactly what is wrong.
            print(f"kiln-{service}: invalid job file:\n{exc}", file=sys.stderr)
            return 2
    tls, problem = _tls(service, args)
    if problem:
        print(f"kiln-{service}: {problem}", file=sys.stderr)
        return 2
    if tls is None:
        log.warning("%s serves plain-text gRPC: any client can call it (insecure mode)", service)
    code = asyncio.run(_serve(service, build, job, args, tls, limits))
    # Stopped cleanly: a second SIGTERM during the interpreter's teardown must not turn this
    # exit into a death by signal.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    return code


async def _serve(service: str, build: BuildFn, job: RLJob | None, args: argparse.Namespace,
                 tls: Bundle | None, limits: ServerLimits) -> int:
    http, _thread = start_http_server(args.metrics_port, addr=metrics_host(args.address))
    metrics_port = http.server_port
    # Bind and answer health checks (NOT_SERVING) before the possibly slow build.
    served = await start_server(args.address, ready=False, tls=tls, limits=limits)
    if args.health_address:
        # The same health servicer, so one watcher bound covers both endpoints.
        probes = _grpc_server([], PROBE_LIMITS)
        health_pb2_grpc.add_HealthServicer_to_server(served.health, probes)
        if probes.add_insecure_port(args.health_address) == 0:
            raise OSError(f"could not bind the health endpoint to {args.health_address}")
        await probes.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if args.port_file:
        write_json_whole(args.port_file, {"port": served.port, "metrics_port": metrics_port,
                                          "pid": os.getpid()})
    log.info("%s listening on port %d, metrics on %d; building", service, served.port, metrics_port)

    build_task = asyncio.ensure_future(build(job, args))
    stop_task = asyncio.ensure_future(stop.wait())
    done, _ = await asyncio.wait({build_task, stop_task}, return_when=asyncio.FIRST_COMPLETED)
    if build_task not in done:
        build_task.cancel()
        await served.server.stop(0)
        http.shutdown()
        return 0
    stop_task.cancel()
    try:
        registrations, on_stop = build_task.result()
    except BaseException:
        # A refused configuration: close the server here, not in the interpreter's teardown.
        await served.server.stop(0)
        http.shutdown()
        raise
    # Libraries imported while building (transformers) may have added plain-text handlers.
    adopt_library_loggers()
    await served.register(registrations, ready=True)
    UP.labels(service).set(1)
    log.info("%s serving %s", service, ", ".join(r.name for r in registrations))
    await stop.wait()
    log.info("%s stopping (grace %.0f s)", service, args.grace)
    UP.labels(service).set(0)
    await set_serving(served.health, served.names, False)
    await served.server.stop(args.grace)
    if on_stop is not None:
        await on_stop()
    http.shutdown()
    return 0
