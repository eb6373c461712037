"""Collective transport: a policy version broadcast from the trainer's rank 0 to rollout engines.

    group = make_group("gloo", "10.0.0.5:29600", rank, world_size)   # NCCL on GPUs
    BroadcastSender(group).send(pack(N, model.named_hf_tensors(), bucket_bytes))   # rank 0
    await BroadcastReceiver(group).feed(receiver)                 # every other rank, for its life

On GPU clusters weights move fastest as one collective over NCCL; this moves the same
checksummed buckets as the gRPC path, so a replica's checks do not depend on the transport: what
a rank receives is handed to its `ReplicaReceiver` as a manifest and buckets, which verifies each
bucket's digest and the manifest digest and applies only a whole version (see `receiver.py`).

On the wire, per version: an int64 length, a header (the sender's `chunk_bytes`, the manifest in
protobuf form, then every bucket's digest), then the buckets' bytes in broadcasts of up to
`chunk_bytes` (whole buckets, so the collective moves large messages). A length of 0 ends the stream. The group is fixed when
it is made: a replica that joins later, or whose group broke, takes versions over gRPC from
weight-sync, which the trainer publishes to as well.

Not covered: wiring into the job spec and the services (which transport a job uses), applying
straight from GPU memory (a NCCL rank copies each chunk to the host to verify it).
"""
from __future__ import annotations

import asyncio
import struct
from collections import deque
from concurrent.futures import Future
from datetime import timedelta
from typing import TYPE_CHECKING, Iterator

from kiln.protos.kiln.v1 import weight_sync_pb2 as pb
from kiln.services.weight_sync import wire
from kiln.services.weight_sync.buckets import Bucket, Manifest, PackedVersion, TransferError

if TYPE_CHECKING:
    import torch.distributed as dist

    from kiln.services.weight_sync.receiver import ReplicaReceiver

DEFAULT_CHUNK_BYTES = 8 << 20
BACKENDS = ("gloo", "nccl")


def make_group(backend: str, address: str, rank: int, world_size: int,
               timeout_s: float = 600.0) -> "dist.ProcessGroup":
    """A process group of `world_size` ranks meeting at `address` (host:port; rank 0 listens
    there). Rank 0 is the trainer's publisher, every other rank a rollout engine."""
    import torch.distributed as dist

    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {BACKENDS}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} must be in [0, world_size={world_size})")
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"address={address!r} must be host:port")
    store = dist.TCPStore(host, int(port), world_size, rank == 0, timedelta(seconds=timeout_s))
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world_size, timedelta(seconds=timeout_s))
    return dist.ProcessGroupNCCL(store, rank, world_size)


def _device(group: "dist.ProcessGroup") -> str:
    return "cuda" if type(group).__name__ == "ProcessGroupNCCL" else "cpu"


def _broadcast(group: "dist.ProcessGroup", tensor: "torch.Tensor") -> None:
    group.broadcast(tensor, 0).wait()


def _chunks(manifest: Manifest, chunk_bytes: int) -> Iterator[range]:
    """Runs of whole buckets of at most `chunk_bytes` (one bucket at least)."""
    start = 0
    while start < manifest.num_buckets:
        end, size = start, 0
        while end < manifest.num_buckets and (end == start or size + manifest.bucket_size(end) <= chunk_bytes):
            size += manifest.bucket_size(end)
            end += 1
        yield range(start, end)
        start = end


class BroadcastSender:
    """Rank 0. `send` blocks until every rank has the version's bytes."""

    def __init__(self, group: "dist.ProcessGroup", chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes={chunk_bytes} must be >= 1")
        self.group, self.chunk_bytes, self.device = group, chunk_bytes, _device(group)

    def _send_bytes(self, data: bytes) -> None:
        import torch

        _broadcast(self.group, torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device))

    def send(self, packed: PackedVersion) -> None:
        import torch

        m = packed.manifest
        header = wire.manifest_to_pb(m).SerializeToString()
        header = (struct.pack("<QI", self.chunk_bytes, len(header)) + header
                  + b"".join(b.digest for b in packed.buckets))
        _broadcast(self.group, torch.tensor([len(header)], dtype=torch.int64, device=self.device))
        self._send_bytes(header)
        for run in _chunks(m, self.chunk_bytes):
            self._send_bytes(b"".join(packed.buckets[i].data for i in run))

    def close(self) -> None:
        """End the stream: every receiver's `feed` returns."""
        import torch

        _broadcast(self.group, torch.zeros(1, dtype=torch.int64, device=self.device))


class BroadcastReceiver:
    """Any rank but 0."""

    def __init__(self, group: "dist.ProcessGroup") -> None:
        self.group, self.device = group, _device(group)
        self.chunk_bytes = DEFAULT_CHUNK_BYTES
        """The sender's, from each version's header."""

    def _receive_bytes(self, n: int) -> memoryview:
        import torch

        t = torch.empty(n, dtype=torch.uint8, device=self.device)
        _broadcast(self.group, t)
        return memoryview(t.cpu().numpy())

    def _header(self) -> tuple[Manifest, list[bytes]] | None:
        import torch

        length = torch.zeros(1, dtype=torch.int64, device=self.device)
        _broadcast(self.group, length)
        n = int(length.item())
        if n == 0:
            return None
        raw = bytes(self._receive_bytes(n))
        if len(raw) < 12:
            raise TransferError("manifest", f"broadcast header of {len(raw)} bytes is too short")
        chunk_bytes, size = struct.unpack_from("<QI", raw)
        if chunk_bytes < 1:
            raise TransferError("manifest", "broadcast header: chunk_bytes must be >= 1")
        self.chunk_bytes = chunk_bytes
        try:
            msg = pb.Manifest.FromString(raw[12:12 + size])
        except Exception as exc:  # a protobuf decode error: the header is garbage
            raise TransferError("manifest", f"broadcast header does not parse: {exc}") from None
        manifest = wire.manifest_from_pb(msg)
        manifest.validate()
        digests = raw[12 + size:]
        if manifest.num_buckets == 0 or len(digests) % manifest.num_buckets:
            raise TransferError("manifest", f"version {manifest.policy_version}: {len(digests)} digest "
                                f"bytes for {manifest.num_buckets} buckets")
        width = len(digests) // manifest.num_buckets
        return manifest, [digests[i * width:(i + 1) * width] for i in range(manifest.num_buckets)]

    def receive(self) -> Iterator[Manifest | Bucket]:
        """The chunks of every version, as they arrive, until rank 0 closes the stream. Blocking:
        every rank must take part in every broadcast, so a version is read to its end even when
        the replica has already refused it."""
        while True:
            header = self._header()
            if header is None:
                return
            manifest, digests = header
            yield manifest
            for run in _chunks(manifest, self.chunk_bytes):
                data = self._receive_bytes(sum(manifest.bucket_size(i) for i in run))
                pos = 0
                for i in run:
                    size = manifest.bucket_size(i)
                    yield Bucket(manifest.policy_version, i, data[pos:pos + size], digests[i])
                    pos += size

    async def feed(self, receiver: "ReplicaReceiver") -> None:
        """Hand every chunk to `receiver` (whose `run` applies verified versions) until rank 0
        closes the stream. The collective calls run on a thread; the receiver on this loop."""
        loop = asyncio.get_running_loop()

        def pump() -> None:
            # The next broadcast is received while the loop checks and stages the buckets of
            # the last one; at most two chunks' bytes wait. The loop runs the hand-offs in the
            # order they are made, so the receiver sees the chunks in order.
            waiting: deque[tuple[Future, int]] = deque()
            held = 0
            for chunk in self.receive():
                size = len(chunk.data) if isinstance(chunk, Bucket) else 0
                waiting.append((asyncio.run_coroutine_threadsafe(receiver.on_chunk(chunk), loop), size))
                held += size
                while held > 2 * self.chunk_bytes:
                    done, size = waiting.popleft()
                    done.result()
                    held -= size
            for done, _ in waiting:
                done.result()

        await asyncio.to_thread(pump)
