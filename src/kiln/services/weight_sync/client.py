"""Client helpers: `publish` for the trainer, `subscribe_and_apply` for a rollout replica.

    # trainer, after optimizer step N
    await publish(channel, N, model.named_hf_tensors(), bucket_bytes=spec.weight_sync.bucket_bytes)

    # rollout replica, for its whole life
    await subscribe_and_apply(channel, "rollout-0", engine.apply_weights)

`publish` snapshots the tensors (one copy) before sending, so the trainer may keep training
while the bytes travel. It returns when the service has committed the version, and raises
`PublishError` (with `retryable`) when it did not. `subscribe_and_apply` reconnects after the
service goes away and runs until cancelled; see `receiver.py` for what it guarantees.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable

import grpc

from kiln.control.retry import TRANSIENT
from kiln.protos.kiln.v1 import weight_sync_pb2 as pb
from kiln.protos.kiln.v1 import weight_sync_pb2_grpc as pb_grpc
from kiln.services.weight_sync import wire
from kiln.services.weight_sync.buckets import DEFAULT_BUCKET_BYTES, PackedVersion, pack
from kiln.services.weight_sync.receiver import ApplyFn, ReplicaReceiver
from kiln.services.weight_sync.servicer import ROLE_METADATA, STREAMS_METADATA

if TYPE_CHECKING:
    import torch

log = logging.getLogger("kiln.weight_sync.client")

# Besides the transient codes: a version that arrived corrupt, or a stream cut short.
_RETRYABLE = TRANSIENT | {grpc.StatusCode.DATA_LOSS, grpc.StatusCode.CANCELLED}
#: What gRPC Python reports when a message could not be sent because the call had already
#: ended: INTERNAL with these details, in place of the status the server ended it with (it
#: records its own send failure first when the two race, as under load). The server's reason is
#: then unknown, and publishing again finds it out.
SEND_FAILED = "Internal error from Core"


class PublishError(RuntimeError):
    """The service did not commit the version. `retryable` says whether publishing the same
    version again can succeed (false for a version that is not newer than the latest)."""

    def __init__(self, version: int, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"publishing version {version} failed: {code.name}: {details}")
        self.policy_version = version
        self.code = code
        self.retryable = code in _RETRYABLE or (code == grpc.StatusCode.INTERNAL
                                                 and details == SEND_FAILED)


@dataclass(frozen=True)
class PublishResult:
    policy_version: int
    bytes: int
    seconds: float
    """Wall time of the transfer (after packing) until the commit was confirmed."""
    pack_seconds: float


async def publish(channel: grpc.aio.Channel, version: int,
                  named_tensors: Iterable[tuple[str, "torch.Tensor"]],
                  bucket_bytes: int = DEFAULT_BUCKET_BYTES, *, streams: int = 1,
                  algorithm: str = "xxh3_64", timeout: float | None = None,
                  snapshot: bool = True, role: str = "version") -> PublishResult:
    """Publish `named_tensors` (Hugging Face names) as policy version `version`. With
    `snapshot=False` nothing is copied up front (the caller leaves the tensors alone until this
    returns, as the trainer's publisher does): packing is one read for the digests, and each
    bucket's bytes are taken as it is sent. `role`: `version`, or `base` / `needs-base`
    (`servicer.ROLE_METADATA`)."""
    t0 = time.perf_counter()
    packed = await asyncio.to_thread(pack, version, list(named_tensors), bucket_bytes, algorithm,
                                     snapshot=snapshot)
    pack_seconds = time.perf_counter() - t0
    return await publish_packed(channel, packed, streams=streams, timeout=timeout,
                                pack_seconds=pack_seconds, role=role)


async def publish_packed(channel: grpc.aio.Channel, packed: PackedVersion, *, streams: int = 1,
                         timeout: float | None = None, pack_seconds: float = 0.0,
                         role: str = "version") -> PublishResult:
    """Send an already packed version over `streams` parallel Publish streams."""
    if streams < 1:
        raise ValueError(f"streams={streams} must be >= 1")
    stub = pb_grpc.WeightSyncStub(channel)
    metadata = ((STREAMS_METADATA, str(streams)),) + (
        ((ROLE_METADATA, role),) if role != "version" else ())
    version = packed.manifest.policy_version
    t0 = time.perf_counter()
    try:
        replies = await asyncio.gather(*[
            stub.Publish(wire.chunks(packed.manifest, packed.buckets, i, streams),
                         metadata=metadata, timeout=timeout)
            for i in range(streams)
        ])
    except grpc.aio.AioRpcError as exc:
        raise PublishError(version, exc.code(), exc.details() or "") from exc
    return PublishResult(version, sum(r.bytes for r in replies), time.perf_counter() - t0,
                         pack_seconds)


async def status(channel: grpc.aio.Channel) -> pb.StatusReply:
    return await pb_grpc.WeightSyncStub(channel).Status(pb.StatusRequest())


def make_receiver(channel: grpc.aio.Channel, replica_id: str, apply_fn: ApplyFn, *,
                  applied_policy_version: int = 0, component: str = "rollout") -> ReplicaReceiver:
    """A receiver whose acknowledgements go to the service on `channel`."""
    stub = pb_grpc.WeightSyncStub(channel)

    async def ack(version: int, ok: bool, error: str) -> None:
        try:
            await stub.Ack(pb.AckRequest(replica_id=replica_id, policy_version=version, ok=ok, error=error))
        except grpc.aio.AioRpcError as exc:
            # The service is down; it learns the replica's state from the next ack.
            log.warning("could not acknowledge version %d: %s", version, exc.code().name)

    return ReplicaReceiver(apply_fn, ack, applied_policy_version=applied_policy_version, component=component)


async def subscribe_and_apply(channel: grpc.aio.Channel, replica_id: str, apply_fn: ApplyFn, *,
                              streams: int = 1, receiver: ReplicaReceiver | None = None,
                              reconnect_delay: float = 1.0) -> None:
    """Receive every new version from the service and apply it with `apply_fn(version,
    named_tensors)`, acknowledging each outcome. Runs until cancelled. Pass `receiver` (from
    `make_receiver`) to watch its state."""
    if streams < 1:
        raise ValueError(f"streams={streams} must be >= 1")
    receiver = receiver or make_receiver(channel, replica_id, apply_fn)
    stub = pb_grpc.WeightSyncStub(channel)

    async def read(index: int) -> None:
        # What it serves, so that a reconnect is not sent again a base it holds (`WeightStore.base_for`).
        call = stub.Subscribe(pb.SubscribeRequest(replica_id=replica_id, stream_index=index,
                                                  num_streams=streams,
                                                  applied_policy_version=receiver.applied_policy_version))
        async for msg in call:
            await receiver.on_chunk(wire.chunk_from_pb(msg))

    apply_task = asyncio.create_task(receiver.run())
    try:
        while True:
            try:
                async with asyncio.TaskGroup() as group:
                    for i in range(streams):
                        group.create_task(read(i))
            except* grpc.aio.AioRpcError as errors:
                for exc in errors.exceptions:
                    log.warning("weight subscription for %s lost: %s", replica_id, exc.code().name)
            await receiver.on_streams_ended()
            await asyncio.sleep(reconnect_delay)
    finally:
        apply_task.cancel()
        await asyncio.gather(apply_task, return_exceptions=True)
