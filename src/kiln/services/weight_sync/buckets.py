"""Turn a policy version's named tensors into checksummed buckets, and buckets back into tensors.

A version is one byte stream: every tensor's raw bytes (C order, native little-endian), one after
another in manifest order. The stream is cut into buckets of exactly `bucket_bytes` (the last
one shorter), so a tensor may span buckets and a bucket may hold many small tensors. Each bucket
carries a digest of its bytes; the manifest names every tensor (name, shape, dtype, offset,
nbytes) and carries a digest over the bucket digests, which binds the buckets to the manifest.

`pack` is the sending side; `Assembly` is the receiving side: it checks each bucket as it
arrives (version, index, length, digest), refuses duplicates, and only hands out tensors once
every bucket is present and the manifest digest matches. Any failure raises `TransferError`
with a `reason` (the SYNC_FAILURES label).

Not covered here: transport (see `wire.py`, `servicer.py`, `client.py`), and adversarial
integrity: the default digest (xxh3_64) detects corruption and truncation, not forgery.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Sequence

import xxhash

if TYPE_CHECKING:
    import torch

DIGEST_ALGORITHMS = ("xxh3_64", "sha256")
DEFAULT_BUCKET_BYTES = 1 << 20
"""Matches `spec.weightSync.bucketBytes`' default; 0.5-1 MiB messages move fastest over gRPC."""

ITEMSIZE: dict[str, int] = {
    "float64": 8, "float32": 4, "bfloat16": 2, "float16": 2,
    "float8_e4m3fn": 1, "float8_e5m2": 1,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
}


class TransferError(ValueError):
    """A version's transfer is unusable. `reason` is one of: checksum, truncated, manifest,
    stale, jump (too far ahead), busy (too many versions in flight). Re-sending the version (or
    publishing a newer one) may succeed; the same bytes will not."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def digest(algorithm: str, data: bytes | memoryview) -> bytes:
    if algorithm == "xxh3_64":
        return xxhash.xxh3_64_digest(data)
    if algorithm == "sha256":
        return hashlib.sha256(data).digest()
    raise ValueError(f"digest_algorithm={algorithm!r} is not one of {DIGEST_ALGORITHMS}")


@dataclass(frozen=True)
class TensorMeta:
    name: str
    shape: tuple[int, ...]
    dtype: str
    offset: int
    nbytes: int


@dataclass(frozen=True)
class Manifest:
    policy_version: int
    tensors: tuple[TensorMeta, ...]
    total_bytes: int
    bucket_bytes: int
    num_buckets: int
    digest_algorithm: str
    digest: bytes

    def bucket_size(self, index: int) -> int:
        """Exact length of bucket `index`."""
        return min(self.bucket_bytes, self.total_bytes - index * self.bucket_bytes)

    def validate(self) -> None:
        """Raise TransferError("manifest") unless the layout is self-consistent."""
        def bad(msg: str) -> TransferError:
            return TransferError("manifest", f"manifest of version {self.policy_version}: {msg}")

        if self.policy_version < 1:
            raise bad("version must be >= 1")
        if self.digest_algorithm not in DIGEST_ALGORITHMS:
            raise bad(f"digest_algorithm {self.digest_algorithm!r} is not one of {DIGEST_ALGORITHMS}")
        if self.bucket_bytes < 1:
            raise bad("bucket_bytes must be >= 1")
        offset = 0
        names = set()
        for t in self.tensors:
            if t.name in names:
                raise bad(f"tensor {t.name!r} appears twice")
            names.add(t.name)
            if t.dtype not in ITEMSIZE:
                raise bad(f"tensor {t.name!r} has unsupported dtype {t.dtype!r}")
            if any(d < 0 for d in t.shape):
                raise bad(f"tensor {t.name!r} has a negative dimension in {t.shape}")
            if t.offset != offset or t.nbytes != math.prod(t.shape) * ITEMSIZE[t.dtype]:
                raise bad(f"tensor {t.name!r} has offset/nbytes inconsistent with the layout")
            offset += t.nbytes
        if offset != self.total_bytes:
            raise bad(f"tensors add up to {offset} bytes, total_bytes says {self.total_bytes}")
        if self.num_buckets != math.ceil(self.total_bytes / self.bucket_bytes):
            raise bad(f"num_buckets {self.num_buckets} does not fit total_bytes/bucket_bytes")


@dataclass(frozen=True)
class Bucket:
    policy_version: int
    index: int
    data: bytes
    digest: bytes


@dataclass(frozen=True)
class PackedVersion:
    manifest: Manifest
    buckets: Sequence[Bucket]


class _DeferredBuckets(Sequence[Bucket]):
    """Buckets whose digests were taken from the tensors' own memory and whose bytes are cut
    from it only when each is sent: packing then costs one read, and the copy into a message
    overlaps the transfer of the buckets before it. The tensors must not change until the
    version is committed; if they do, the bytes no longer match the digests and the service
    refuses the version (checksum): a torn version is never committed."""

    def __init__(self, version: int, pieces: list[list[memoryview]], digests: list[bytes]) -> None:
        self._version, self._pieces, self._digests = version, pieces, digests

    def __len__(self) -> int:
        return len(self._digests)

    def __getitem__(self, index):  # type: ignore[override]
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        pieces = self._pieces[index]
        data = pieces[0].tobytes() if len(pieces) == 1 else b"".join(pieces)
        return Bucket(self._version, range(len(self))[index], data, self._digests[index])


def _hasher(algorithm: str):
    if algorithm == "xxh3_64":
        return xxhash.xxh3_64()
    if algorithm == "sha256":
        return hashlib.sha256()
    raise ValueError(f"digest_algorithm={algorithm!r} is not one of {DIGEST_ALGORITHMS}")


def _tensor_bytes(tensor: "torch.Tensor") -> memoryview:
    """A zero-copy byte view of a CPU tensor (copied once if not contiguous or not on the CPU)."""
    import torch

    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous().reshape(-1)
    return memoryview(t.view(torch.uint8).numpy())


def dtype_name(tensor: "torch.Tensor") -> str:
    name = str(tensor.dtype).removeprefix("torch.")
    if name not in ITEMSIZE:
        raise ValueError(f"tensor dtype {tensor.dtype} cannot be synced (supported: {sorted(ITEMSIZE)})")
    return name


def pack(version: int, named_tensors: Iterable[tuple[str, "torch.Tensor"]], bucket_bytes: int,
         algorithm: str = "xxh3_64", *, snapshot: bool = True) -> PackedVersion:
    """Snapshot `named_tensors` as version `version`: one copy of the bytes, cut into buckets.
    Without `snapshot`, no copy: the digests are taken now and each bucket's bytes when it is
    sent, for a caller that leaves the tensors alone until the commit (see `_DeferredBuckets`)."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes={bucket_bytes} must be >= 1")
    if not snapshot:
        return _pack_deferred(version, named_tensors, bucket_bytes, algorithm)
    metas: list[TensorMeta] = []
    views: list[memoryview] = []
    offset = 0
    for name, tensor in named_tensors:
        view = _tensor_bytes(tensor)
        metas.append(TensorMeta(name, tuple(tensor.shape), dtype_name(tensor), offset, view.nbytes))
        views.append(view)
        offset += view.nbytes
    total = offset
    buckets: list[Bucket] = []
    pieces: list[memoryview] = []
    filled = 0
    for view in views:
        pos = 0
        while pos < view.nbytes:
            take = min(bucket_bytes - filled, view.nbytes - pos)
            pieces.append(view[pos:pos + take])
            pos += take
            filled += take
            if filled == bucket_bytes:
                data = b"".join(pieces)
                buckets.append(Bucket(version, len(buckets), data, digest(algorithm, data)))
                pieces, filled = [], 0
    if filled:
        data = b"".join(pieces)
        buckets.append(Bucket(version, len(buckets), data, digest(algorithm, data)))
    manifest = Manifest(
        policy_version=version, tensors=tuple(metas), total_bytes=total, bucket_bytes=bucket_bytes,
        num_buckets=len(buckets), digest_algorithm=algorithm,
        digest=digest(algorithm, b"".join(b.digest for b in buckets)),
    )
    manifest.validate()
    return PackedVersion(manifest, buckets)


def _pack_deferred(version: int, named_tensors: Iterable[tuple[str, "torch.Tensor"]],
                   bucket_bytes: int, algorithm: str) -> PackedVersion:
    metas: list[TensorMeta] = []
    pieces: list[list[memoryview]] = []
    digests: list[bytes] = []
    current: list[memoryview] = []
    hasher, filled, offset = _hasher(algorithm), 0, 0
    for name, tensor in named_tensors:
        view = _tensor_bytes(tensor)
        metas.append(TensorMeta(name, tuple(tensor.shape), dtype_name(tensor), offset, view.nbytes))
        offset += view.nbytes
        pos = 0
        while pos < view.nbytes:
            take = min(bucket_bytes - filled, view.nbytes - pos)
            piece = view[pos:pos + take]
            current.append(piece)
            hasher.update(piece)
            pos += take
            filled += take
            if filled == bucket_bytes:
                pieces.append(current)
                digests.append(hasher.digest())
                current, hasher, filled = [], _hasher(algorithm), 0
    if filled:
        pieces.append(current)
        digests.append(hasher.digest())
    manifest = Manifest(
        policy_version=version, tensors=tuple(metas), total_bytes=offset, bucket_bytes=bucket_bytes,
        num_buckets=len(digests), digest_algorithm=algorithm, digest=digest(algorithm, b"".join(digests)),
    )
    manifest.validate()
    return PackedVersion(manifest, _DeferredBuckets(version, pieces, digests))


class Assembly:
    """Collects the buckets of one version, checking each on arrival.

    With `stage`, each bucket's bytes are copied on arrival into one buffer laid out as the
    version (a replica: the copy overlaps the transfer of the next buckets, and `tensors()` then
    hands out views of that buffer without another copy); the buckets kept hold their digests
    only. The buffer is allocated when the first bucket has passed its checks."""

    def __init__(self, manifest: Manifest, *, stage: bool = False) -> None:
        manifest.validate()
        self.manifest = manifest
        # Filled as buckets arrive: memory follows the bytes received, not what a manifest claims.
        self.buckets: dict[int, Bucket] = {}
        self.received = 0
        self.received_bytes = 0
        self.stage = stage
        self.buffer: bytearray | None = None

    @property
    def policy_version(self) -> int:
        return self.manifest.policy_version

    @property
    def complete(self) -> bool:
        return self.received == self.manifest.num_buckets

    def add(self, bucket: Bucket) -> None:
        m = self.manifest
        where = f"version {m.policy_version} bucket {bucket.index}"
        if bucket.policy_version != m.policy_version:
            raise TransferError("manifest", f"{where}: bucket says version {bucket.policy_version}")
        if not 0 <= bucket.index < m.num_buckets:
            raise TransferError("manifest", f"{where}: index out of range (0..{m.num_buckets - 1})")
        if bucket.index in self.buckets:
            raise TransferError("manifest", f"{where}: received twice")
        if len(bucket.data) != m.bucket_size(bucket.index):
            raise TransferError(
                "truncated", f"{where}: {len(bucket.data)} bytes, expected {m.bucket_size(bucket.index)}")
        if digest(m.digest_algorithm, bucket.data) != bucket.digest:
            raise TransferError("checksum", f"{where}: data does not match its {m.digest_algorithm} digest")
        if self.stage:
            if self.buffer is None:
                self.buffer = bytearray(m.total_bytes)
            start = bucket.index * m.bucket_bytes
            self.buffer[start:start + len(bucket.data)] = bucket.data
            bucket = Bucket(bucket.policy_version, bucket.index, b"", bucket.digest)
        self.buckets[bucket.index] = bucket
        self.received += 1
        self.received_bytes += len(bucket.data)

    def finish(self) -> list[Bucket]:
        """All buckets, in order; raises TransferError if any is missing or the set is not the
        one the manifest describes."""
        m = self.manifest
        if not self.complete:
            missing = m.num_buckets - self.received
            raise TransferError("truncated", f"version {m.policy_version}: {missing} of {m.num_buckets} buckets missing")
        buckets = [self.buckets[i] for i in range(m.num_buckets)]
        if digest(m.digest_algorithm, b"".join(b.digest for b in buckets)) != m.digest:
            raise TransferError("checksum", f"version {m.policy_version}: bucket digests do not match the manifest digest")
        return buckets


    def tensors(self) -> list[tuple[str, "torch.Tensor"]]:
        """The named tensors of a staged version, once `finish()` has verified it: views of the
        staging buffer, no copy."""
        if not self.stage:
            raise ValueError("tensors() needs an Assembly made with stage=True; use to_tensors")
        self.finish()
        return _views(self.manifest, self.buffer if self.buffer is not None else bytearray())


def to_tensors(manifest: Manifest, buckets: Sequence[Bucket]) -> list[tuple[str, "torch.Tensor"]]:
    """The named tensors of a verified version (they share one freshly allocated buffer)."""
    buffer = bytearray(manifest.total_bytes)
    view = memoryview(buffer)
    pos = 0
    for b in buckets:
        view[pos:pos + len(b.data)] = b.data
        pos += len(b.data)
    return _views(manifest, buffer)


def _views(manifest: Manifest, buffer: bytearray) -> list[tuple[str, "torch.Tensor"]]:
    import torch

    out = []
    for t in manifest.tensors:
        dtype = getattr(torch, t.dtype)
        count = t.nbytes // ITEMSIZE[t.dtype]
        if count == 0:
            out.append((t.name, torch.empty(t.shape, dtype=dtype)))
            continue
        flat = torch.frombuffer(buffer, dtype=dtype, count=count, offset=t.offset)
        out.append((t.name, flat.reshape(t.shape)))
    return out
