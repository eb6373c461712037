"""Conversions between the weight-sync domain types (`buckets.py`) and `kiln.v1` protobufs.

Kept apart so that the store, the receiver and the bucketing know nothing of protobuf or gRPC.
"""
from __future__ import annotations

from typing import Iterator, Sequence

from kiln.protos.kiln.v1 import weight_sync_pb2 as pb
from kiln.services.weight_sync.buckets import Bucket, Manifest, TensorMeta


def manifest_to_pb(m: Manifest) -> pb.Manifest:
    return pb.Manifest(
        policy_version=m.policy_version,
        tensors=[pb.TensorEntry(name=t.name, shape=list(t.shape), dtype=t.dtype, offset=t.offset,
                                nbytes=t.nbytes) for t in m.tensors],
        total_bytes=m.total_bytes, bucket_bytes=m.bucket_bytes, num_buckets=m.num_buckets,
        digest_algorithm=m.digest_algorithm, digest=m.digest,
    )


def manifest_from_pb(msg: pb.Manifest) -> Manifest:
    return Manifest(
        policy_version=msg.policy_version,
        tensors=tuple(TensorMeta(t.name, tuple(t.shape), t.dtype, t.offset, t.nbytes)
                      for t in msg.tensors),
        total_bytes=msg.total_bytes, bucket_bytes=msg.bucket_bytes, num_buckets=msg.num_buckets,
        digest_algorithm=msg.digest_algorithm, digest=msg.digest,
    )


def bucket_to_pb(b: Bucket) -> pb.Bucket:
    return pb.Bucket(policy_version=b.policy_version, index=b.index, data=b.data, digest=b.digest)


def bucket_from_pb(msg: pb.Bucket) -> Bucket:
    return Bucket(msg.policy_version, msg.index, msg.data, msg.digest)


def chunk_from_pb(msg: pb.WeightChunk) -> Manifest | Bucket:
    kind = msg.WhichOneof("kind")
    if kind == "manifest":
        return manifest_from_pb(msg.manifest)
    if kind == "bucket":
        return bucket_from_pb(msg.bucket)
    raise ValueError("WeightChunk has neither manifest nor bucket set")


def stream_indices(num_buckets: int, stream_index: int, num_streams: int) -> range:
    """Bucket indices carried by stream `stream_index` of `num_streams` (round robin)."""
    num_streams = max(num_streams, 1)
    if not 0 <= stream_index < num_streams:
        raise ValueError(f"stream_index={stream_index} must be in [0, num_streams={num_streams})")
    return range(stream_index, num_buckets, num_streams)


def chunks(manifest: Manifest, buckets: Sequence[Bucket], stream_index: int = 0,
           num_streams: int = 1) -> Iterator[pb.WeightChunk]:
    """The messages of one stream of a version: the manifest, then its share of the buckets."""
    yield pb.WeightChunk(manifest=manifest_to_pb(manifest))
    for i in stream_indices(len(buckets), stream_index, num_streams):
        yield pb.WeightChunk(bucket=bucket_to_pb(buckets[i]))
