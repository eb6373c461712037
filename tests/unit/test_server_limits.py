"""The bounds every Kiln gRPC server keeps: open Health.Watch streams, RPCs in flight, the size
of one request."""
from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kiln.services.common.server import ServerLimits, create_server


async def _first(call) -> int:
    return (await call.read()).status


def test_health_watch_streams_are_bounded():
    async def go():
        server, port = await create_server("127.0.0.1:0", limits=ServerLimits(max_health_watchers=2))
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                stub = health_pb2_grpc.HealthStub(ch)
                first = [stub.Watch(health_pb2.HealthCheckRequest(service=f"s{i}")) for i in range(2)]
                for call in first:
                    await _first(call)
                extra = stub.Watch(health_pb2.HealthCheckRequest())
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await extra.read()
                assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                first[0].cancel()
                for _ in range(100):  # the server sees the cancellation a moment later
                    await asyncio.sleep(0.01)
                    again = stub.Watch(health_pb2.HealthCheckRequest())
                    try:
                        assert await _first(again) == health_pb2.HealthCheckResponse.SERVING
                        break
                    except grpc.aio.AioRpcError:
                        continue
                else:
                    raise AssertionError("a closed watcher's place was never freed")
                # Check is never refused for watchers.
                assert (await stub.Check(health_pb2.HealthCheckRequest())).status == 1
        finally:
            await server.stop(0)

    asyncio.run(go())


def test_concurrent_rpcs_and_request_size_are_bounded():
    async def go():
        limits = ServerLimits(max_concurrent_rpcs=2, max_receive_bytes=4096)
        server, port = await create_server("127.0.0.1:0", limits=limits)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                stub = health_pb2_grpc.HealthStub(ch)
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.Check(health_pb2.HealthCheckRequest(service="x" * 8192))
                assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                held = [stub.Watch(health_pb2.HealthCheckRequest()) for _ in range(2)]
                for call in held:
                    await _first(call)
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.Check(health_pb2.HealthCheckRequest())
                assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                for call in held:
                    call.cancel()
        finally:
            await server.stop(0)

    asyncio.run(go())
