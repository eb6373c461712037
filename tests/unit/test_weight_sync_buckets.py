"""Bucketing, verification and the replica's verify-and-apply rules, without gRPC."""
from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch

from kiln.services.weight_sync.buckets import (
    Assembly, Bucket, Manifest, TransferError, pack, to_tensors)
from kiln.services.weight_sync.receiver import ReplicaReceiver
from kiln.services.weight_sync.store import WeightStore


def _tensors(seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        ("model.embed_tokens.weight", torch.randn(37, 16, generator=g)),
        ("model.norm.weight", torch.randn(16, generator=g).to(torch.bfloat16)),
        ("model.layers.0.self_attn.q_proj.bias", torch.randn(5, generator=g).to(torch.float16)),
        ("counter", torch.arange(7, dtype=torch.int64)),
        ("empty", torch.zeros(0, 3)),
        ("lm_head.weight", torch.randn(16, 37, generator=g).t()),  # not contiguous
    ]


def _flip(b: Bucket, pos: int = 0) -> Bucket:
    data = bytearray(b.data)
    data[pos] ^= 0x01
    return dataclasses.replace(b, data=bytes(data))


@pytest.mark.parametrize("bucket_bytes", [1, 100, 4096, 1 << 20])
@pytest.mark.parametrize("algorithm", ["xxh3_64", "sha256"])
def test_round_trip_exact(bucket_bytes: int, algorithm: str) -> None:
    src = _tensors()
    packed = pack(3, src, bucket_bytes, algorithm)
    m = packed.manifest
    assert m.total_bytes == sum(t.numel() * t.element_size() for _, t in src)
    assert all(len(b.data) == bucket_bytes for b in packed.buckets[:-1])
    assert len(packed.buckets) == m.num_buckets
    a = Assembly(m)
    for b in reversed(packed.buckets):  # order of arrival does not matter
        a.add(b)
    back = to_tensors(m, a.finish())
    staged = Assembly(m, stage=True)  # a replica's: bytes copied into place on arrival
    for b in reversed(packed.buckets):
        staged.add(b)
    for out in (back, staged.tensors()):
        assert [n for n, _ in out] == [n for n, _ in src]
        for (_, x), (_, y) in zip(src, out):
            assert x.dtype == y.dtype and x.shape == y.shape
            assert torch.equal(x, y)


def test_deferred_pack_sends_the_same_bytes_and_a_torn_version_is_refused() -> None:
    # Without a snapshot the bytes are read as each bucket is sent; the digests were taken
    # before: weights that change in between must fail the checks, never commit a mix.
    src = [(n, t.clone()) for n, t in _tensors()]
    snap = pack(4, src, 100)
    deferred = pack(4, src, 100, snapshot=False)
    assert deferred.manifest == snap.manifest and len(deferred.buckets) == len(snap.buckets)
    assert [b.data for b in deferred.buckets] == [b.data for b in snap.buckets]
    a = Assembly(deferred.manifest)
    for b in deferred.buckets:
        a.add(b)
    assert all(torch.equal(x, y) for (_, x), (_, y) in zip(src, to_tensors(a.manifest, a.finish())))
    torn = pack(5, src, 100, snapshot=False)
    src[0][1][3, 2] += 1.0  # the trainer stepped while its weights were being sent
    a = Assembly(torn.manifest)
    with pytest.raises(TransferError) as err:
        for b in torn.buckets:
            a.add(b)
    assert err.value.reason == "checksum"


def test_corrupt_bucket_is_rejected() -> None:
    packed = pack(1, _tensors(), 64)
    a = Assembly(packed.manifest)
    a.add(packed.buckets[0])
    with pytest.raises(TransferError) as err:
        a.add(_flip(packed.buckets[1], 10))
    assert err.value.reason == "checksum"


def test_short_bucket_and_missing_bucket_are_truncation() -> None:
    packed = pack(1, _tensors(), 64)
    short = dataclasses.replace(packed.buckets[2], data=packed.buckets[2].data[:-1])
    with pytest.raises(TransferError) as err:
        Assembly(packed.manifest).add(short)
    assert err.value.reason == "truncated"
    a = Assembly(packed.manifest)
    for b in packed.buckets[:-1]:
        a.add(b)
    with pytest.raises(TransferError) as err:
        a.finish()
    assert err.value.reason == "truncated"


def test_bucket_of_another_version_or_duplicate_is_rejected() -> None:
    one, two = pack(1, _tensors(0), 64), pack(2, _tensors(1), 64)
    a = Assembly(one.manifest)
    with pytest.raises(TransferError):
        a.add(two.buckets[0])
    a.add(one.buckets[0])
    with pytest.raises(TransferError):
        a.add(one.buckets[0])


def test_swapped_buckets_with_valid_digests_fail_manifest_digest() -> None:
    # Buckets of equal size swapped, each with its own (valid) digest: only the manifest digest
    # catches that they are in the wrong place.
    packed = pack(1, [("w", torch.arange(64, dtype=torch.float32))], 64)
    b0, b1 = packed.buckets[0], packed.buckets[1]
    a = Assembly(packed.manifest)
    a.add(dataclasses.replace(b1, index=0))
    a.add(dataclasses.replace(b0, index=1))
    for b in packed.buckets[2:]:
        a.add(b)
    with pytest.raises(TransferError) as err:
        a.finish()
    assert err.value.reason == "checksum"


def test_inconsistent_manifest_is_rejected() -> None:
    m = pack(1, _tensors(), 64).manifest
    bad = dataclasses.replace(m, total_bytes=m.total_bytes + 1)
    with pytest.raises(TransferError) as err:
        Assembly(bad)
    assert err.value.reason == "manifest"
    t0 = dataclasses.replace(m.tensors[0], shape=(1, 1))
    with pytest.raises(TransferError):
        Assembly(dataclasses.replace(m, tensors=(t0, *m.tensors[1:])))


# --- receiver -----------------------------------------------------------------------------


class Recorder:
    """An apply target that records calls; with `gated`, each apply waits for `release`, so
    newer versions can arrive while one is being applied, however slow the machine."""

    def __init__(self, gated: bool = False) -> None:
        self.gate = asyncio.Event()
        if not gated:
            self.gate.set()
        self.started: list[int] = []
        self.calls: list[tuple[int, dict[str, torch.Tensor]]] = []
        self.acks: list[tuple[int, bool]] = []

    async def apply(self, version: int, tensors) -> None:
        self.started.append(version)
        await self.gate.wait()
        self.calls.append((version, dict(tensors)))

    async def ack(self, version: int, ok: bool, error: str) -> None:
        self.acks.append((version, ok))


async def _feed(r: ReplicaReceiver, packed, buckets=None) -> None:
    await r.on_chunk(packed.manifest)
    for b in packed.buckets if buckets is None else buckets:
        await r.on_chunk(b)


def test_receiver_applies_verified_and_rejects_corrupt() -> None:
    async def main() -> None:
        rec = Recorder()
        r = ReplicaReceiver(rec.apply, rec.ack)
        task = asyncio.create_task(r.run())
        v1 = pack(1, _tensors(1), 64)
        await _feed(r, v1)
        await asyncio.wait_for(r.wait_applied(1), 60)
        v2 = pack(2, _tensors(2), 64)
        await _feed(r, v2, [v2.buckets[0], _flip(v2.buckets[1]), *v2.buckets[2:]])
        v3 = pack(3, _tensors(3), 64)
        await _feed(r, v3, v3.buckets[:-1])
        await r.on_streams_ended()
        for _ in range(6000):  # both refused, however slow the machine
            if len(r.rejected) >= 2:
                break
            await asyncio.sleep(0.01)
        task.cancel()
        assert [v for v, _ in rec.calls] == [1]
        assert torch.equal(rec.calls[0][1]["model.embed_tokens.weight"], _tensors(1)[0][1])
        assert r.applied_policy_version == 1
        assert r.rejected == [(2, "checksum"), (3, "truncated")]
        assert rec.acks == [(1, True), (2, False), (3, False)]

    asyncio.run(main())


def test_receiver_drops_a_cut_version_and_takes_it_again_whole() -> None:
    # The service forwards a version while it is published; a publish that fails part-way ends
    # the streams. Nothing of the part is applied, and the version republished comes exactly.
    async def main() -> None:
        rec = Recorder()
        r = ReplicaReceiver(rec.apply, rec.ack)
        task = asyncio.create_task(r.run())
        v1 = pack(1, _tensors(1), 40)
        await _feed(r, v1, v1.buckets[:-2])
        await r.on_streams_ended()
        assert r.rejected == [(1, "truncated")]
        await _feed(r, v1, [*v1.buckets[2:], *v1.buckets[:2]])
        await asyncio.wait_for(r.wait_applied(1), 60)
        task.cancel()
        assert [v for v, _ in rec.calls] == [1] and rec.acks == [(1, False), (1, True)]
        got = rec.calls[0][1]
        assert all(torch.equal(got[n], t) for n, t in _tensors(1))

    asyncio.run(main())


def test_receiver_latest_wins_and_never_goes_back() -> None:
    async def main() -> None:
        rec = Recorder(gated=True)
        r = ReplicaReceiver(rec.apply, rec.ack)
        task = asyncio.create_task(r.run())
        await _feed(r, pack(1, _tensors(1), 64))
        for _ in range(1000):  # version 1 is being applied (held until released)
            if rec.started:
                break
            await asyncio.sleep(0.01)
        assert rec.started == [1]
        await _feed(r, pack(2, _tensors(2), 64))
        await _feed(r, pack(3, _tensors(3), 64))  # supersedes 2 before it is applied
        p5 = pack(5, _tensors(5), 64)
        await r.on_chunk(p5.manifest)
        await r.on_chunk(p5.buckets[0])  # partial 5 ...
        await _feed(r, pack(6, _tensors(6), 64))  # ... abandoned for 6
        for b in p5.buckets[1:]:
            await r.on_chunk(b)  # late buckets of the abandoned 5 are ignored
        rec.gate.set()
        await asyncio.wait_for(r.wait_applied(6), 60)
        await _feed(r, pack(2, _tensors(2), 64))  # going backwards is ignored
        await asyncio.sleep(0.3)
        task.cancel()
        # 2 and 3 were verified while 1 was applied, then 6 superseded them before their turn.
        assert [v for v, _ in rec.calls] == [1, 6]
        assert torch.equal(rec.calls[1][1]["counter"], _tensors(6)[3][1])
        assert r.applied == [1, 6] and r.rejected == []

    asyncio.run(main())


def test_store_versions_only_move_forward() -> None:
    async def main() -> None:
        store = WeightStore()
        for version in (1, 2):
            packed = pack(version, _tensors(version), 64)
            pending = store.open_stream(packed.manifest)
            for b in packed.buckets:
                store.add_bucket(pending, b)
            store.close_stream(pending)
            assert (await pending.done).policy_version == version
        assert store.policy_version == 2
        with pytest.raises(TransferError) as err:
            store.open_stream(pack(2, _tensors(9), 64).manifest)
        assert err.value.reason == "stale"
        # A corrupt publish of 3 fails and leaves 2 in place.
        packed = pack(3, _tensors(3), 64)
        pending = store.open_stream(packed.manifest)
        with pytest.raises(TransferError):
            store.add_bucket(pending, _flip(packed.buckets[0]))
        store.close_stream(pending)
        assert store.policy_version == 2
        with pytest.raises(TransferError):
            await pending.done

    asyncio.run(main())


def test_store_refuses_a_leap_ahead_but_not_a_first_version() -> None:
    async def main() -> None:
        store = WeightStore(max_version_step=4)

        async def commit(version: int) -> None:
            packed = pack(version, _tensors(version), 64)
            pending = store.open_stream(packed.manifest)
            for b in packed.buckets:
                store.add_bucket(pending, b)
            store.close_stream(pending)
            await pending.done

        await commit(40)  # a fresh weight-sync takes a resumed trainer's version
        with pytest.raises(TransferError) as err:
            store.open_stream(pack(2**64 - 1, _tensors(1), 64).manifest)
        assert err.value.reason == "jump" and "maxVersionStep" in str(err.value)
        await commit(44)
        assert store.policy_version == 44

    asyncio.run(main())


def test_claims_cost_nothing_until_bytes_arrive_and_pending_versions_are_bounded() -> None:
    from kiln.services.weight_sync.store import MAX_PENDING

    async def main() -> None:
        store = WeightStore(abandon_after_s=0.2)
        # A manifest claiming a huge layout allocates nothing per claimed bucket.
        huge = pack(1, _tensors(1), 64).manifest
        claimed = dataclasses.replace(huge, tensors=(dataclasses.replace(huge.tensors[0], shape=(1 << 26,),
                                                                          nbytes=4 << 26),),
                                      total_bytes=4 << 26, bucket_bytes=4,
                                      num_buckets=1 << 26)
        pending = store.open_stream(claimed)
        assert pending.assembly.buckets == {}
        for v in range(2, MAX_PENDING + 1):
            store.open_stream(pack(v, _tensors(v), 64).manifest, expected_streams=64)
        with pytest.raises(TransferError) as err:
            store.open_stream(pack(99, _tensors(1), 64).manifest)
        assert err.value.reason == "busy"
        # Half-finished publishes are dropped after the timeout, and publishing works again.
        await asyncio.sleep(0.3)
        packed = pack(100, _tensors(1), 64)
        fresh = store.open_stream(packed.manifest)
        for b in packed.buckets:
            store.add_bucket(fresh, b)
        store.close_stream(fresh)
        assert (await fresh.done).policy_version == 100
        for p in (pending,):
            with pytest.raises(TransferError):
                await p.done

    asyncio.run(main())


def test_status_stays_bounded_whoever_sends_acks(monkeypatch) -> None:
    from kiln.services.weight_sync import store as store_module

    monkeypatch.setattr(store_module, "MAX_REPLICAS", 3)

    async def main() -> None:
        store = WeightStore()
        with pytest.raises(ValueError, match="has not subscribed"):
            store.record_ack("anyone", 1, False, "x" * 10_000)
        for r in ("r0", "r1", "r2"):
            store.add_replica(r)
        store.add_replica("r1")  # a reconnect keeps its state
        with pytest.raises(ValueError, match="at most 3"):
            store.add_replica("r3")
        state = store.record_ack("r0", 1, False, "x" * 10_000)
        assert len(state.last_error) == store_module.MAX_ERROR_CHARS and len(store.replicas) == 3

    asyncio.run(main())
