"""Weight sync of LoRA versions over real gRPC on loopback: while the latest version is an adapter,
a replica that does not hold its base (the last version of complete weights) is sent that base
first, and the adapter only once it has applied the base; a replica that holds it is not sent it
again when it reconnects. The engine is a stand-in that records what it is given (the merge itself
is tested with real engines in test_lora_late_joiner.py)."""
from __future__ import annotations

import asyncio

import grpc
import torch

from kiln.control.channels import CHANNEL_OPTIONS
from kiln.models.lora_names import BASE_DIGEST
from kiln.protos.kiln.v1 import weight_sync_pb2 as pb
from kiln.protos.kiln.v1 import weight_sync_pb2_grpc as pb_grpc
from kiln.services.common.server import Registration, create_server
from kiln.services.weight_sync import client as ws
from kiln.services.weight_sync import wire
from kiln.services.weight_sync.buckets import Manifest
from kiln.services.weight_sync.servicer import SERVICE_NAME, WeightSyncServicer

BUCKET = 1024
W = "model.layers.0.self_attn.q_proj"


def complete(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [("model.embed_tokens.weight", torch.randn(64, 16, generator=g)),
            (f"{W}.weight", torch.randn(16, 16, generator=g))]


def adapter(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(f"base_model.model.{W}.lora_A.weight", torch.randn(4, 16, generator=g)),
            (f"base_model.model.{W}.lora_B.weight", torch.randn(16, 4, generator=g)),
            (BASE_DIGEST, torch.tensor([1.0], dtype=torch.float64))]


async def _wait_for(cond, timeout: float = 60.0) -> None:
    async with asyncio.timeout(timeout):
        while not cond():
            await asyncio.sleep(0.01)


async def test_a_replica_without_the_base_gets_it_first_and_applies_it_before_the_adapter() -> None:
    servicer = WeightSyncServicer(commit_timeout=30)
    server, port = await create_server(
        "127.0.0.1:0", [Registration(pb_grpc.add_WeightSyncServicer_to_server, servicer, SERVICE_NAME)])
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=CHANNEL_OPTIONS)
    gate = asyncio.Event()
    applied: list[tuple[int, set[str]]] = []
    seen: list[tuple[int, str]] = []  # (version, kind) of every chunk in the order it arrived

    async def apply(version, tensors) -> None:
        if not applied:
            await gate.wait()  # the base's apply is slow: nothing of the adapter may arrive meanwhile
        applied.append((version, {n for n, _ in tensors}))

    receiver = ws.make_receiver(channel, "late", apply)
    on_chunk = receiver.on_chunk

    async def recording(chunk) -> None:
        seen.append((chunk.policy_version, "manifest" if isinstance(chunk, Manifest) else "bucket"))
        await on_chunk(chunk)
    receiver.on_chunk = recording
    task = None
    try:
        await ws.publish(channel, 1, complete(1), BUCKET)
        await ws.publish(channel, 2, complete(2), BUCKET)
        await ws.publish(channel, 3, adapter(3), BUCKET)
        await ws.publish(channel, 4, adapter(4), BUCKET)
        assert servicer.store.base.policy_version == 2 and servicer.store.policy_version == 4
        task = asyncio.create_task(ws.subscribe_and_apply(channel, "late", apply, receiver=receiver,
                                                          reconnect_delay=0.05, streams=2))
        await _wait_for(lambda: sum(1 for v, k in seen if v == 2 and k == "bucket") ==
                        servicer.store.base.manifest.num_buckets)
        await asyncio.sleep(0.2)  # room for a wrongly early adapter to arrive
        assert {v for v, _ in seen} == {2}
        gate.set()
        await _wait_for(lambda: receiver.applied_policy_version == 4)
        assert [v for v, _ in applied] == [2, 4] and receiver.rejected == []
        assert applied[0][1] == {n for n, _ in complete(2)} and BASE_DIGEST in applied[1][1]

        # Holding the base (version 4 applied on it), a replica is not sent it again.
        stub = pb_grpc.WeightSyncStub(channel)
        call = stub.Subscribe(pb.SubscribeRequest(replica_id="again", applied_policy_version=3))
        first = wire.chunk_from_pb(await call.read())
        call.cancel()
        assert isinstance(first, Manifest) and first.policy_version == 4
        fresh = stub.Subscribe(pb.SubscribeRequest(replica_id="fresh"))
        first = wire.chunk_from_pb(await fresh.read())
        fresh.cancel()
        assert isinstance(first, Manifest) and first.policy_version == 2
    finally:
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        await channel.close()
        await server.stop(0)


def test_a_base_publish_is_kept_as_the_base_and_never_served_as_a_version() -> None:
    """The roles of a publish (`x-kiln-publish-role`): an adapter that needs a base is refused
    while none is held (FAILED_PRECONDITION, "no-base"); a base is complete weights, kept as
    the base only (the latest version does not move, no subscriber is woken); an adapter as a
    base, or a base older than the one held, is refused."""
    async def main() -> None:
        servicer = WeightSyncServicer(commit_timeout=30)
        server, port = await create_server(
            "127.0.0.1:0", [Registration(pb_grpc.add_WeightSyncServicer_to_server, servicer, SERVICE_NAME)])
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=CHANNEL_OPTIONS)
        try:
            try:
                await ws.publish(channel, 5, adapter(1), BUCKET, role="needs-base")
                raise AssertionError("an adapter needing a base was taken without one")
            except ws.PublishError as exc:
                assert exc.code == grpc.StatusCode.FAILED_PRECONDITION and "no-base" in str(exc)
                assert not exc.retryable
            await ws.publish(channel, 3, complete(2), BUCKET, role="base")
            store = servicer.store
            assert store.base.policy_version == 3 and store.latest is None and store.policy_version == 0
            for tensors, version, why in ((adapter(1), 4, "not an adapter"), (complete(2), 2, "older")):
                try:
                    await ws.publish(channel, version, tensors, BUCKET, role="base")
                    raise AssertionError(f"a base that is {why} was taken")
                except ws.PublishError:
                    pass
            await ws.publish(channel, 5, adapter(1), BUCKET, role="needs-base")
            assert store.policy_version == 5 and store.base.policy_version == 3
        finally:
            await channel.close()
            await server.stop(0)

    asyncio.run(main())
