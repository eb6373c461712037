"""Weight sync into a real engine while the version is still being published (cut-through).

A replica receives and stages a version's buckets as the trainer publishes them; the engine only
ever switches to a version that arrived whole and verified: the exact published bytes, or
nothing (a publish that fails part-way leaves the engine on the old version, serving it).
"""
from __future__ import annotations

import asyncio
import dataclasses
from contextlib import asynccontextmanager

import grpc
import pytest
import torch
from safetensors.torch import load_file

from kiln.control.channels import CHANNEL_OPTIONS
from kiln.models.tiny import make_tiny_model, train_tokenizer
from kiln.protos.kiln.v1 import weight_sync_pb2_grpc as pb_grpc
from kiln.services.common.server import Registration, create_server
from kiln.services.rollout.engine import EngineSettings, SamplingOptions
from kiln.services.rollout.torch_engine import TorchEngine
from kiln.services.weight_sync import client as ws
from kiln.services.weight_sync import wire
from kiln.services.weight_sync.buckets import Bucket, pack
from kiln.services.weight_sync.servicer import SERVICE_NAME, STREAMS_METADATA, WeightSyncServicer

BUCKET = 16 << 10


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    root = tmp_path_factory.mktemp("ws_e2e")
    tok = train_tokenizer([f"text {i} for weights" for i in range(100)], root / "tok", vocab_size=300)
    return make_tiny_model(root / "m", tok, seed=0)


def version_weights(model_dir, scale: float) -> list[tuple[str, torch.Tensor]]:
    return [(n, t * scale) for n, t in load_file(str(model_dir / "model.safetensors")).items()]


async def wait_for(cond, timeout: float = 60.0) -> None:
    async with asyncio.timeout(timeout):
        while not cond():
            await asyncio.sleep(0.01)


@asynccontextmanager
async def service():
    servicer = WeightSyncServicer(commit_timeout=30)
    server, port = await create_server(
        "127.0.0.1:0", [Registration(pb_grpc.add_WeightSyncServicer_to_server, servicer, SERVICE_NAME)])
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=CHANNEL_OPTIONS)
    try:
        yield channel
    finally:
        await channel.close()
        await server.stop(0)


def served_equals(engine: TorchEngine, weights) -> bool:
    params = dict(engine.model.named_parameters())
    return all(torch.equal(params[n], t) for n, t in weights if n in params)


def test_version_is_staged_while_published_and_applied_exactly_or_not_at_all(model) -> None:
    async def main() -> None:
        engine = await TorchEngine.start(EngineSettings(model=str(model), dtype="float32"))
        async with service() as ch:
            received: dict[int, int] = {}
            receiver = ws.make_receiver(ch, "r", engine.apply_weights)
            receive = receiver.on_chunk

            async def on_chunk(chunk) -> None:
                await receive(chunk)
                if isinstance(chunk, Bucket):
                    received[chunk.policy_version] = received.get(chunk.policy_version, 0) + 1
            receiver.on_chunk = on_chunk
            task = asyncio.create_task(ws.subscribe_and_apply(ch, "r", engine.apply_weights,
                                                              receiver=receiver, reconnect_delay=0.05))
            stub = pb_grpc.WeightSyncStub(ch)

            async def publish(packed, cut: int, buckets=None):
                """The manifest and the first `cut` buckets; once the replica holds them (the
                version is not committed yet), the rest (of `buckets`, if given)."""
                msgs = list(wire.chunks(packed.manifest, buckets or packed.buckets))

                async def chunks():
                    for msg in msgs[:1 + cut]:
                        yield msg
                    await wait_for(lambda: received.get(packed.manifest.policy_version, 0) >= cut)
                    for msg in msgs[1 + cut:]:
                        yield msg
                return await stub.Publish(chunks(), metadata=((STREAMS_METADATA, "1"),))

            v1 = version_weights(model, 1.5)
            packed1 = pack(1, v1, BUCKET)
            assert packed1.manifest.num_buckets > 4
            await publish(packed1, cut=3)
            await wait_for(lambda: engine.policy_version == 1)
            assert served_equals(engine, v1)

            # Version 2 fails part-way: the replica got its first buckets before the corrupt one.
            # Nothing is sent after it: a message sent after the service has ended the call is
            # reported as the sender's own INTERNAL, not as the service's status.
            packed2 = pack(2, version_weights(model, 0.5), BUCKET)
            bad = bytearray(packed2.buckets[3].data)
            bad[5] ^= 0x10
            corrupt = list(packed2.buckets[:4])
            corrupt[3] = dataclasses.replace(packed2.buckets[3], data=bytes(bad))
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await publish(packed2, cut=3, buckets=corrupt)
            assert err.value.code() == grpc.StatusCode.DATA_LOSS
            # The replica held 3 verified buckets of 2; the service ended its stream, and it
            # dropped them.
            await wait_for(lambda: (2, "truncated") in receiver.rejected)
            assert engine.policy_version == 1 and served_equals(engine, v1)
            gen = await engine.generate([1, 2, 3], SamplingOptions(max_tokens=3, temperature=0.0))
            assert set(gen.versions) == {1}

            # Republished intact, it comes whole, and exactly.
            received.pop(2, None)
            await publish(packed2, cut=2)
            await wait_for(lambda: engine.policy_version == 2)
            assert served_equals(engine, version_weights(model, 0.5))
            assert receiver.applied == [1, 2]
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        await engine.close()

    asyncio.run(main())
