"""Weight sync over real gRPC on loopback: trainer publishes, replicas subscribe, verify, apply."""
from __future__ import annotations

import asyncio
import dataclasses
from contextlib import asynccontextmanager

import grpc
import pytest
import torch

from kiln.protos.kiln.v1 import weight_sync_pb2_grpc as pb_grpc
from kiln.control.channels import CHANNEL_OPTIONS
from kiln.services.common.server import Registration, create_server
from kiln.services.weight_sync import client as ws
from kiln.services.weight_sync import wire
from kiln.services.weight_sync.buckets import Bucket, pack
from kiln.services.weight_sync.servicer import SERVICE_NAME, STREAMS_METADATA, WeightSyncServicer

BUCKET = 4096


def weights(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        ("model.embed_tokens.weight", torch.randn(64, 32, generator=g)),
        ("model.layers.0.mlp.up_proj.weight", torch.randn(96, 32, generator=g).to(torch.bfloat16)),
        ("model.norm.weight", torch.randn(32, generator=g)),
    ]


class Replica:
    """A stand-in engine: keeps the applied tensors. With `gated`, each apply waits for `gate`,
    so newer versions arrive while one is applied however slow the machine; `buckets` counts
    the buckets received of each version."""

    def __init__(self, channel: grpc.aio.Channel, name: str, gated: bool = False) -> None:
        self.name = name
        self.gate = asyncio.Event()
        if not gated:
            self.gate.set()
        self.started: list[int] = []
        self.buckets: dict[int, int] = {}
        self.state: dict[str, torch.Tensor] = {}
        self.receiver = ws.make_receiver(channel, name, self.apply)
        receive = self.receiver.on_chunk

        async def on_chunk(chunk) -> None:
            await receive(chunk)
            if isinstance(chunk, Bucket):
                self.buckets[chunk.policy_version] = self.buckets.get(chunk.policy_version, 0) + 1
        self.receiver.on_chunk = on_chunk
        self.task = asyncio.create_task(
            ws.subscribe_and_apply(channel, name, self.apply, receiver=self.receiver,
                                   reconnect_delay=0.05))

    async def apply(self, version: int, tensors) -> None:
        self.started.append(version)
        await self.gate.wait()
        self.state = {n: t.clone() for n, t in tensors}

    def matches(self, seed: int) -> bool:
        return self.state.keys() == dict(weights(seed)).keys() and all(
            torch.equal(self.state[n], t) for n, t in weights(seed))

    async def stop(self) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)


@asynccontextmanager
async def service():
    servicer = WeightSyncServicer(commit_timeout=10)
    server, port = await create_server(
        "127.0.0.1:0", [Registration(pb_grpc.add_WeightSyncServicer_to_server, servicer, SERVICE_NAME)])
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=CHANNEL_OPTIONS)
    try:
        yield servicer, channel
    finally:
        await channel.close()
        await server.stop(0)


async def wait_for(cond, timeout: float = 60.0) -> None:
    async with asyncio.timeout(timeout):
        while not cond():
            await asyncio.sleep(0.01)


def test_version_reaches_two_replicas_intact_and_acks_are_recorded() -> None:
    async def main() -> None:
        async with service() as (servicer, ch):
            a, b = Replica(ch, "r-a"), Replica(ch, "r-b")
            result = await ws.publish(ch, 1, weights(1), BUCKET)
            assert result.policy_version == 1 and result.bytes == sum(t.nbytes for _, t in weights(1))
            await wait_for(lambda: a.receiver.applied_policy_version == 1 == b.receiver.applied_policy_version)
            assert a.matches(1) and b.matches(1)
            await ws.publish(ch, 2, weights(2), BUCKET, streams=3)  # parallel publish streams
            await wait_for(lambda: a.receiver.applied_policy_version == 2 == b.receiver.applied_policy_version)
            assert a.matches(2) and b.matches(2)
            await wait_for(lambda: len(servicer.store.replicas) == 2 and all(
                s.applied_policy_version == 2 for s in servicer.store.replicas.values()))
            st = await ws.status(ch)
            assert st.policy_version == 2
            assert [(r.replica_id, r.applied_policy_version, r.last_ok) for r in st.replicas] == [
                ("r-a", 2, True), ("r-b", 2, True)]
            await a.stop(), await b.stop()

    asyncio.run(main())


def test_late_joiner_gets_only_the_latest() -> None:
    async def main() -> None:
        async with service() as (_, ch):
            for v in (1, 2, 3):
                await ws.publish(ch, v, weights(v), BUCKET)
            late = Replica(ch, "late")
            await wait_for(lambda: late.receiver.applied_policy_version == 3)
            await asyncio.sleep(0.1)
            assert late.receiver.applied == [3] and late.matches(3)
            await late.stop()

    asyncio.run(main())


def test_corrupted_or_truncated_publish_is_rejected_and_old_version_kept() -> None:
    async def main() -> None:
        async with service() as (servicer, ch):
            r = Replica(ch, "r")
            await ws.publish(ch, 1, weights(1), BUCKET)
            await wait_for(lambda: r.receiver.applied_policy_version == 1)
            packed = pack(2, weights(2), BUCKET)
            data = bytearray(packed.buckets[1].data)
            data[7] ^= 0x40
            corrupt = list(packed.buckets)
            corrupt[1] = dataclasses.replace(packed.buckets[1], data=bytes(data))
            with pytest.raises(ws.PublishError) as err:
                await ws.publish_packed(ch, dataclasses.replace(packed, buckets=corrupt))
            assert err.value.code == grpc.StatusCode.DATA_LOSS and err.value.retryable
            # Truncated: the stream ends before the last bucket.
            stub = pb_grpc.WeightSyncStub(ch)
            with pytest.raises(grpc.aio.AioRpcError) as rpc_err:
                await stub.Publish(list(wire.chunks(packed.manifest, packed.buckets))[:-1],
                                   metadata=((STREAMS_METADATA, "1"),))
            assert rpc_err.value.code() == grpc.StatusCode.DATA_LOSS
            assert "truncated" in rpc_err.value.details()
            assert servicer.store.policy_version == 1
            await asyncio.sleep(0.1)
            assert r.receiver.applied == [1] and r.matches(1)
            # The same version, sent intact, then goes through.
            await ws.publish_packed(ch, packed)
            await wait_for(lambda: r.receiver.applied_policy_version == 2)
            assert r.matches(2)
            await r.stop()

    asyncio.run(main())


def test_corruption_on_the_way_to_a_replica_is_rejected_and_old_weights_kept() -> None:
    async def main() -> None:
        async with service() as (servicer, ch):
            await ws.publish(ch, 1, weights(1), BUCKET)
            r = Replica(ch, "r")
            await wait_for(lambda: r.receiver.applied_policy_version == 1)
            await r.stop()
            await ws.publish(ch, 2, weights(2), BUCKET)
            # Damage the bytes the service holds (as a bad link or memory would): the replica
            # must catch it with the bucket digest.
            stored = servicer.store.latest
            bad = bytearray(stored.buckets[0].data)
            bad[0] ^= 0xFF
            stored.buckets[0] = dataclasses.replace(stored.buckets[0], data=bytes(bad))
            r2 = Replica(ch, "r")
            r2.receiver.applied_policy_version, r2.state = 1, dict(r.state)
            await wait_for(lambda: r2.receiver.rejected)
            assert r2.receiver.rejected[0] == (2, "checksum")
            assert r2.receiver.applied_policy_version == 1 and r2.matches(1)
            await wait_for(lambda: servicer.store.replicas["r"].last_policy_version == 2)
            s = servicer.store.replicas["r"]
            assert (s.applied_policy_version, s.last_ok) == (1, False) and "checksum" in s.last_error
            await r2.stop()

    asyncio.run(main())


def test_new_version_while_replica_applies_previous_never_goes_back() -> None:
    async def main() -> None:
        async with service() as (servicer, ch):
            slow = Replica(ch, "slow", gated=True)
            fast = Replica(ch, "fast")
            await ws.publish(ch, 1, weights(1), BUCKET)
            await wait_for(lambda: slow.started == [1])  # slow is applying 1 (held there)
            for v in (2, 3, 4):
                await ws.publish(ch, v, weights(v), BUCKET)
            # Every bucket of 4 has reached slow while it still applies 1: then it lets go.
            await wait_for(lambda: slow.buckets.get(4) == len(pack(4, weights(4), BUCKET).buckets))
            slow.gate.set()
            await wait_for(lambda: slow.receiver.applied_policy_version == 4 == fast.receiver.applied_policy_version)
            assert slow.matches(4) and fast.matches(4)
            for rep in (slow, fast):
                assert rep.receiver.applied == sorted(set(rep.receiver.applied))
                assert rep.receiver.applied[0] == 1 and rep.receiver.applied[-1] == 4
            assert slow.receiver.applied == [1, 4]  # it skipped the superseded 2 and 3
            # Publishing an older or equal version is refused, and nothing moves back.
            with pytest.raises(ws.PublishError) as err:
                await ws.publish(ch, 3, weights(9), BUCKET)
            assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION and not err.value.retryable
            await asyncio.sleep(0.1)
            assert servicer.store.policy_version == 4 and slow.matches(4) and fast.matches(4)
            await slow.stop(), await fast.stop()

    asyncio.run(main())


def test_parallel_subscribe_streams_deliver_intact() -> None:
    async def main() -> None:
        async with service() as (_, ch):
            rec: dict[int, dict[str, torch.Tensor]] = {}

            async def apply(version, tensors):
                rec[version] = {n: t.clone() for n, t in tensors}

            receiver = ws.make_receiver(ch, "multi", apply)
            task = asyncio.create_task(ws.subscribe_and_apply(ch, "multi", apply, streams=3,
                                                              receiver=receiver))
            await ws.publish(ch, 1, weights(1), BUCKET, streams=2)
            await wait_for(lambda: receiver.applied_policy_version == 1)
            assert all(torch.equal(rec[1][n], t) for n, t in weights(1))
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    asyncio.run(main())
