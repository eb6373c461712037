"""A minimal service process for the bootstrap tests: one unary Echo method, a slow build.

Run as a script: python tests/helpers/echo_service.py --address 127.0.0.1:0 --port-file F ...
The build sleeps (like a model load) so tests can observe NOT_SERVING before SERVING, and the
on_stop hook writes a file (like a trainer's checkpoint on SIGTERM).
"""
from __future__ import annotations

import asyncio
import sys

import grpc

from kiln.services.common.server import Registration, run_service, service_argparser

SERVICE = "kiln.test.Echo"


async def _echo(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    if request == b"fail":
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "asked to fail")
    return b"echo:" + request


def _add(servicer: object, server: grpc.aio.Server) -> None:
    handler = grpc.method_handlers_generic_handler(
        SERVICE, {"Echo": grpc.unary_unary_rpc_method_handler(_echo)})
    server.add_generic_rpc_handlers((handler,))


def main() -> int:
    parser = service_argparser("echo")
    parser.add_argument("--build-seconds", type=float, default=1.0)

    async def build(job, args):
        await asyncio.sleep(args.build_seconds)

        async def on_stop() -> None:
            (args.run_dir / "stopped").write_text("clean")

        return [Registration(_add, None, SERVICE)], on_stop

    return run_service("echo", build, parser=parser)


if __name__ == "__main__":
    sys.exit(main())
