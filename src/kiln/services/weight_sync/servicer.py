"""gRPC servicer for `kiln.v1.WeightSync`: translates between protobuf and `WeightStore`.

Status codes say whether retrying helps: FAILED_PRECONDITION for a version that is not newer
than the latest (republishing it will never succeed) or for an adapter version that needs a
base the service does not hold ("no-base": publish the base, then the version again), DATA_LOSS for a corrupt or truncated
publish (republishing may), INVALID_ARGUMENT for a malformed stream (a bug in the sender).
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from typing import AsyncIterator

import grpc

from kiln.protos.kiln.v1 import weight_sync_pb2 as pb
from kiln.protos.kiln.v1 import weight_sync_pb2_grpc as pb_grpc
from kiln.services.common.metrics import SYNC_BYTES
from kiln.services.common.ratelimit import LogLimiter
from kiln.services.weight_sync import wire
from kiln.services.weight_sync.buckets import Bucket, Manifest, TransferError
from kiln.services.weight_sync.store import PendingVersion, WeightStore

log = logging.getLogger("kiln.weight_sync")
# Refused publishes and acks are logged a few a minute per reason; the counters see them all.
_REJECTED = LogLimiter(burst=5, period_s=60)

SERVICE_NAME = "kiln.v1.WeightSync"
STREAMS_METADATA = "x-kiln-publish-streams"
"""A publish split over N parallel streams sends N here on every stream (default 1)."""
ROLE_METADATA = "x-kiln-publish-role"
"""`base`: the complete weights later adapter versions apply to (`WeightStore.open_base`);
`needs-base`: an adapter version on trained weights, refused while no base is held; absent: a
version."""
ROLES = ("version", "base", "needs-base")

_CODES = {
    "stale": grpc.StatusCode.FAILED_PRECONDITION,
    "manifest": grpc.StatusCode.INVALID_ARGUMENT,
    "jump": grpc.StatusCode.INVALID_ARGUMENT,
    "busy": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "checksum": grpc.StatusCode.DATA_LOSS,
    "truncated": grpc.StatusCode.DATA_LOSS,
    "no-base": grpc.StatusCode.FAILED_PRECONDITION,
}


MAX_STREAMS = 64


def _expected_streams(context: grpc.aio.ServicerContext) -> int:
    for key, value in context.invocation_metadata() or ():
        if key == STREAMS_METADATA:
            try:
                streams = int(value)
            except ValueError:
                raise TransferError("manifest", f"{STREAMS_METADATA}: {value!r} is not a number") from None
            if not 1 <= streams <= MAX_STREAMS:
                raise TransferError("manifest", f"{STREAMS_METADATA}: {streams} is not in 1..{MAX_STREAMS}")
            return streams
    return 1


def _role(context: grpc.aio.ServicerContext) -> str:
    role = dict(context.invocation_metadata() or ()).get(ROLE_METADATA, "version")
    if role not in ROLES:
        raise TransferError("manifest", f"{ROLE_METADATA}: {role!r} is not one of {ROLES}")
    return role


SHARED_CHUNKS = 32
"""Bucket messages kept for the subscribers that follow a version in step (see `_chunk`)."""


class WeightSyncServicer(pb_grpc.WeightSyncServicer):
    def __init__(self, store: WeightStore | None = None, *, commit_timeout: float = 120.0) -> None:
        self.store = store or WeightStore()
        self.commit_timeout = commit_timeout
        self._chunks: OrderedDict[tuple[int, int, bytes], pb.WeightChunk] = OrderedDict()

    def _chunk(self, bucket: Bucket) -> pb.WeightChunk:
        """The message carrying `bucket`. Replicas fed while a version is published all wait for
        the same bucket, so the message (one copy of its bytes) is built once for all of them;
        only the last few are kept, so memory stays bounded whoever lags behind."""
        msg = self._chunks.get(self._key(bucket))
        if msg is None:
            msg = pb.WeightChunk(bucket=wire.bucket_to_pb(bucket))
            self._keep(bucket, msg)
        return msg

    @staticmethod
    def _key(bucket: Bucket) -> tuple[int, int, bytes]:
        # The digest too: a version whose publish failed may be published again with other bytes.
        return (bucket.policy_version, bucket.index, bucket.digest)

    def _keep(self, bucket: Bucket, msg: pb.WeightChunk) -> None:
        self._chunks[self._key(bucket)] = msg
        if len(self._chunks) > SHARED_CHUNKS:
            self._chunks.popitem(last=False)

    async def Publish(self, request_iterator: AsyncIterator[pb.WeightChunk],
                      context: grpc.aio.ServicerContext) -> pb.PublishReply:
        pending: PendingVersion | None = None
        nbytes = 0
        start = time.monotonic()
        try:
            try:
                async for msg in request_iterator:
                    try:
                        chunk = wire.chunk_from_pb(msg)
                    except ValueError as exc:  # an empty or malformed chunk
                        raise TransferError("manifest", str(exc)) from None
                    if pending is None:
                        if not isinstance(chunk, Manifest):
                            raise TransferError("manifest", "a publish stream must start with the manifest")
                        role = _role(context)
                        pending = (self.store.open_base(chunk, _expected_streams(context))
                                   if role == "base" else
                                   self.store.open_stream(chunk, _expected_streams(context),
                                                          needs_base=role == "needs-base"))
                    elif isinstance(chunk, Manifest):
                        raise TransferError("manifest", "a publish stream carries one manifest")
                    else:
                        self.store.add_bucket(pending, chunk)
                        nbytes += len(chunk.data)
            finally:
                if pending is not None:
                    self.store.close_stream(pending)
        except TransferError as exc:
            _REJECTED.log(log, logging.WARNING, ("publish", exc.reason),
                          "publish rejected (%s): %s", exc.reason, exc)
            await context.abort(_CODES[exc.reason], f"{exc.reason}: {exc}")
        if pending is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "empty publish stream")
        try:
            stored = await asyncio.wait_for(asyncio.shield(pending.done), self.commit_timeout)
        except TransferError as exc:
            await context.abort(_CODES[exc.reason], f"{exc.reason}: {exc}")
        except asyncio.TimeoutError:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                f"version {pending.assembly.policy_version} not complete after "
                                f"{self.commit_timeout:.0f} s; republish it")
        log.info("version %d committed (%d bytes)", stored.policy_version, stored.manifest.total_bytes)
        return pb.PublishReply(policy_version=stored.policy_version, bytes=nbytes,
                               seconds=time.monotonic() - start)

    async def Subscribe(self, request: pb.SubscribeRequest,
                        context: grpc.aio.ServicerContext) -> AsyncIterator[pb.WeightChunk]:
        replica = request.replica_id
        if not replica:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "replica_id must be set")
        n = max(request.num_streams, 1)
        try:
            wire.stream_indices(0, request.stream_index, n)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        try:
            self.store.add_replica(replica)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        sent = request.applied_policy_version
        while True:
            source = await self.store.wait_source(sent)
            base = self.store.base_for(source, sent)
            if base is not None:
                # A LoRA adapter on weights this replica does not hold: the base goes first,
                # whole, and the adapter only once the replica is done with it (else a newer
                # complete version could replace the base in its receiver before it is applied).
                acks = self.store.replicas[replica].acks
                yield pb.WeightChunk(manifest=wire.manifest_to_pb(base.manifest))
                for i in wire.stream_indices(base.manifest.num_buckets, request.stream_index, n):
                    # Not through `_chunk`: one replica's catch-up must not evict the messages
                    # the others share.
                    yield pb.WeightChunk(bucket=wire.bucket_to_pb(base.buckets[i]))
                    SYNC_BYTES.inc(len(base.buckets[i].data))
                log.info("replica %s: sent base version %d before version %d", replica,
                         base.policy_version, source.policy_version)
                try:
                    await asyncio.wait_for(self.store.wait_ack(replica, acks, base.policy_version),
                                           self.commit_timeout)
                except asyncio.TimeoutError:
                    log.warning("replica %s did not acknowledge base version %d", replica, base.policy_version)
                sent = base.policy_version
                continue
            version = source.policy_version
            yield pb.WeightChunk(manifest=wire.manifest_to_pb(source.manifest))
            for i in wire.stream_indices(source.manifest.num_buckets, request.stream_index, n):
                if self.store.newest_version > version:
                    log.info("replica %s: abandoning version %d for %d",
                             replica, version, self.store.newest_version)
                    break
                if isinstance(source, PendingVersion):
                    try:
                        bucket = await source.bucket(i)
                    except TransferError as exc:
                        # The replica holds part of a version that will never be complete: end
                        # the stream so that it drops the part (and takes a republish whole).
                        await context.abort(grpc.StatusCode.ABORTED,
                                            f"version {version} was not published: {exc}")
                else:
                    bucket = source.buckets[i]
                yield self._chunk(bucket)
                SYNC_BYTES.inc(len(bucket.data))
            sent = version

    async def Ack(self, request: pb.AckRequest, context: grpc.aio.ServicerContext) -> pb.AckReply:
        try:
            state = self.store.record_ack(request.replica_id, request.policy_version, request.ok,
                                          request.error)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        if not request.ok:
            _REJECTED.log(log, logging.WARNING, ("ack", request.replica_id[:80]),
                          "replica %s rejected version %d: %s (still on %d)",
                          request.replica_id[:80], request.policy_version,
                          request.error[:200], state.applied_policy_version)
        return pb.AckReply()

    async def Status(self, request: pb.StatusRequest, context: grpc.aio.ServicerContext) -> pb.StatusReply:
        return pb.StatusReply(
            policy_version=self.store.policy_version,
            replicas=[pb.ReplicaState(replica_id=s.replica_id, applied_policy_version=s.applied_policy_version,
                                      last_policy_version=s.last_policy_version, last_ok=s.last_ok,
                                      last_error=s.last_error)
                      for s in sorted(self.store.replicas.values(), key=lambda s: s.replica_id)],
        )
