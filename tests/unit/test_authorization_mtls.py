"""Authorization over the wire, in one process and in about a second: Kiln's gRPC server
(`start_server`, mutual TLS with certificates of one job's CA) in front of every service, and a
client holding each component's certificate calling each RPC of the reviewed table
(test_authorization.py), streaming ones included: the components the table names get through,
every other one is refused PERMISSION_DENIED before the servicer runs. The buffer's and weight
sync's real servicers show that a refused call changes nothing; a caller without a certificate
of the job fails the handshake. The same with the real service processes: the slow
tests/integration/test_mtls.py."""
from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import grpc
import pytest

from kiln.control.channels import aio_channel
from kiln.protos.kiln.v1 import (buffer_pb2, buffer_pb2_grpc, env_pb2, rollout_pb2, sandbox_pb2,
                                 trainer_pb2, weight_sync_pb2, weight_sync_pb2_grpc)
from kiln.services.buffer.buffer import TrajectoryBuffer
from kiln.services.buffer.servicer import BufferServicer
from kiln.services.buffer.types import BufferConfig
from kiln.services.common.server import Registration, start_server
from kiln.services.weight_sync.servicer import WeightSyncServicer
from kiln.tls import COMPONENTS, issue, new_authority

from helpers.authorization import REVIEWED

DENIED = grpc.StatusCode.PERMISSION_DENIED
REACHED = grpc.StatusCode.FAILED_PRECONDITION  # what the stand-in servicers answer
SERVED_BY = {"kiln.v1.Buffer": "buffer", "kiln.v1.Environment": "sandbox",
             "kiln.v1.Sandbox": "sandbox", "kiln.v1.Rollout": "rollout",
             "kiln.v1.Trainer": "trainer", "kiln.v1.WeightSync": "weight-sync"}


@pytest.fixture(scope="module")
def bundles():
    ca = new_authority("authz")
    return {c: issue(ca, c) for c in COMPONENTS}, issue(new_authority("another-job"), "trainer")


def _kinds() -> dict[str, tuple[str, bool, bool]]:
    """Full method name -> (service, client streams, server streams), from the protos."""
    out = {}
    for module in (buffer_pb2, env_pb2, rollout_pb2, sandbox_pb2, trainer_pb2, weight_sync_pb2):
        for service in module.DESCRIPTOR.services_by_name.values():
            for m in service.methods:
                out[f"/{service.full_name}/{m.name}"] = (service.full_name, m.client_streaming,
                                                         m.server_streaming)
    return out


def _stand_in(service: str, methods: dict[str, tuple[bool, bool]]) -> Registration:
    """Every method of `service`, of its real kind, answering REACHED: the servicer ran."""
    async def unary(request, context):
        await context.abort(REACHED, "reached")

    async def stream(request, context):
        await context.abort(REACHED, "reached")
        yield b""

    make = {(False, False): grpc.unary_unary_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler,
            (False, True): grpc.unary_stream_rpc_method_handler,
            (True, True): grpc.stream_stream_rpc_method_handler}
    handler = grpc.method_handlers_generic_handler(service, {
        name: make[kind](stream if kind[1] else unary) for name, kind in methods.items()})
    return Registration(lambda _, server: server.add_generic_rpc_handlers((handler,)), None, service)


async def _code(ch: grpc.aio.Channel, method: str, client_streams: bool, server_streams: bool,
                request: bytes = b"") -> grpc.StatusCode:
    try:
        if client_streams and server_streams:
            call = ch.stream_stream(method)(iter([request]), timeout=20)
        elif server_streams:
            call = ch.unary_stream(method)(request, timeout=20)
        elif client_streams:
            await ch.stream_unary(method)(iter([request]), timeout=20)
            return grpc.StatusCode.OK
        else:
            await ch.unary_unary(method)(request, timeout=20)
            return grpc.StatusCode.OK
        async for _ in call:
            pass
        return grpc.StatusCode.OK
    except grpc.aio.AioRpcError as exc:
        return exc.code()


def test_every_component_reaches_exactly_the_rpcs_of_the_reviewed_table(bundles) -> None:
    certs, _ = bundles
    kinds = _kinds()
    assert set(kinds) == set(REVIEWED)
    assert {k[1:] for k in kinds.values()} >= {(True, False), (False, True)}  # streams both ways

    async def main() -> dict[tuple[str, str], grpc.StatusCode]:
        by_component: dict[str, dict[str, dict[str, tuple[bool, bool]]]] = {}
        for method, (service, cs, ss) in kinds.items():
            by_component.setdefault(SERVED_BY[service], {}).setdefault(service, {})[
                method.rsplit("/", 1)[1]] = (cs, ss)
        servers = {component: await start_server(
            "127.0.0.1:0", [_stand_in(s, m) for s, m in services.items()], tls=certs[component])
            for component, services in by_component.items()}
        try:
            got = {}
            for caller in COMPONENTS:
                for component, served in servers.items():
                    async with aio_channel(f"127.0.0.1:{served.port}", component,
                                           bundle=certs[caller]) as ch:
                        for method, (service, cs, ss) in kinds.items():
                            if SERVED_BY[service] == component:
                                got[(method, caller)] = await _code(ch, method, cs, ss)
            return got
        finally:
            for served in servers.values():
                await served.server.stop(0)

    got = asyncio.run(main())
    expected = {(m, c): REACHED if c in REVIEWED[m] else DENIED for m in REVIEWED for c in COMPONENTS}
    assert len(got) == 33 * len(COMPONENTS)
    assert {k: v for k, v in got.items() if v != expected[k]} == {}


def test_a_refused_call_changes_nothing_on_the_real_servicers(bundles, tmp_path: Path) -> None:
    """The anonymous-looking `SetPolicyVersion(2^64-1)` that would make the buffer drop
    everything, and weight sync's streams both ways (a replica subscribing, a publish)."""
    certs, other_job = bundles
    buffer = TrajectoryBuffer.open(tmp_path / "buffer", BufferConfig())
    weights = WeightSyncServicer()

    async def main() -> None:
        buf = await start_server("127.0.0.1:0", [Registration(
            buffer_pb2_grpc.add_BufferServicer_to_server, BufferServicer(buffer), "kiln.v1.Buffer")],
            tls=certs["buffer"])
        ws = await start_server("127.0.0.1:0", [Registration(
            weight_sync_pb2_grpc.add_WeightSyncServicer_to_server, weights, "kiln.v1.WeightSync")],
            tls=certs["weight-sync"])

        def ch(served, component, caller, bundle=None):
            return aio_channel(f"127.0.0.1:{served.port}", component, bundle=bundle or certs[caller])

        async def code(call) -> grpc.StatusCode:
            try:
                result = call()
                if hasattr(result, "__aiter__"):
                    async for _ in result:
                        pass
                else:
                    await result
                return grpc.StatusCode.OK
            except grpc.aio.AioRpcError as exc:
                return exc.code()

        try:
            # Buffer: the rollout's certificate may not move the policy version; the trainer's may.
            huge = buffer_pb2.SetPolicyVersionRequest(policy_version=2**64 - 1)
            async with ch(buf, "buffer", "rollout") as c:
                assert await code(lambda: buffer_pb2_grpc.BufferStub(c).SetPolicyVersion(huge)) == DENIED
                # The refusal names the caller and the method; a method no servicer has is
                # unimplemented for every caller, not passed on unchecked.
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await buffer_pb2_grpc.BufferStub(c).SetPolicyVersion(huge)
                assert refused.value.details() == \
                    "rollout may not call /kiln.v1.Buffer/SetPolicyVersion"
                assert await code(lambda: c.unary_unary("/kiln.v1.Buffer/Unknown")(
                    b"", timeout=5)) == grpc.StatusCode.UNIMPLEMENTED
            assert buffer.status().policy_version == 0
            async with ch(buf, "buffer", "trainer", other_job) as c:  # another job's CA
                assert await code(lambda: buffer_pb2_grpc.BufferStub(c).SetPolicyVersion(
                    huge, timeout=5)) == grpc.StatusCode.UNAVAILABLE
            async with ch(buf, "buffer", "trainer") as c:
                stub = buffer_pb2_grpc.BufferStub(c)
                await stub.SetPolicyVersion(buffer_pb2.SetPolicyVersionRequest(policy_version=3))
            assert buffer.status().policy_version == 3
            # Weight sync: a trainer may not subscribe (a server stream), a rollout may not
            # publish (a client stream); the store never hears of either.
            async with ch(ws, "weight-sync", "trainer") as c:
                stub = weight_sync_pb2_grpc.WeightSyncStub(c)
                sub = weight_sync_pb2.SubscribeRequest(replica_id="intruder")
                assert await code(lambda: stub.Subscribe(sub, timeout=5)) == DENIED
                # The trainer's publish reaches the servicer (which refuses an empty stream).
                assert await code(lambda: stub.Publish(iter([]), timeout=5)) \
                    == grpc.StatusCode.INVALID_ARGUMENT
            async with ch(ws, "weight-sync", "rollout") as c:
                stub = weight_sync_pb2_grpc.WeightSyncStub(c)
                assert await code(lambda: stub.Publish(iter([weight_sync_pb2.WeightChunk()]),
                                                       timeout=5)) == DENIED
                assert not (await stub.Status(weight_sync_pb2.StatusRequest())).replicas
                # A rollout's subscription is served: the replica is known while it waits
                # for a first version.
                sub = stub.Subscribe(weight_sync_pb2.SubscribeRequest(replica_id="r0"), timeout=60)
                waiting = asyncio.ensure_future(code(lambda: sub))
                for _ in range(400):
                    status = await stub.Status(weight_sync_pb2.StatusRequest())
                    if status.replicas or waiting.done():
                        break
                    await asyncio.sleep(0.05)
                assert [r.replica_id for r in status.replicas] == ["r0"], await waiting
                assert status.policy_version == 0
                sub.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await waiting
        finally:
            await buf.server.stop(0)
            await ws.server.stop(0)

    try:
        asyncio.run(main())
    finally:
        buffer.close()
