"""Lease and acknowledge: a served batch is consumed only when acked; one whose lease ends without
an ack (timeout, restart) is served again under its batch id, after freshness control; acks are
idempotent and durable. All on a real TrajectoryBuffer in a temporary directory."""
from __future__ import annotations

import time
from pathlib import Path

from kiln.services.buffer.buffer import TrajectoryBuffer
from kiln.services.buffer.types import BufferConfig
from kiln.services.buffer.leases import AckStatus
from kiln.services.buffer.synthetic import synthetic_group
from kiln.services.common import metrics


def _open(path: Path, **kw) -> TrajectoryBuffer:
    return TrajectoryBuffer.open(path, BufferConfig(**kw))


def _ids(batch) -> list[str]:
    return [t.id for t in batch.trajectories]


def test_only_an_ack_consumes(tmp_path: Path) -> None:
    buf = _open(tmp_path, group_size=2, segment_bytes=1)  # one Put per segment
    buf.put(synthetic_group("a", 2))
    buf.put(synthetic_group("b", 2))
    batch = buf.try_get_batch(2, 0)
    st = buf.status()
    assert (st.depth, st.leased, st.leases, st.served, st.batches) == (2, 2, 1, 0, 1)
    assert len(buf.store.segment_files()) == 2  # a's records are kept while leased
    ack = buf.ack_batch(batch.batch_id)
    assert (ack.status, ack.trajectories) == (AckStatus.ACKED, 2)
    st = buf.status()
    assert (st.depth, st.leased, st.leases, st.served, st.batches_acked) == (2, 0, 0, 2, 1)
    assert len(buf.store.segment_files()) == 1  # and reclaimed once acked
    buf.close()
    buf = _open(tmp_path, group_size=2)
    assert buf.status().leased == 0
    assert _ids(buf.try_get_batch(4, 0, allow_partial=True)) == ["b/0", "b/1"]
    buf.close()


def test_ack_is_idempotent_and_says_why(tmp_path: Path) -> None:
    buf = _open(tmp_path, group_size=2)
    buf.put(synthetic_group("a", 2) + synthetic_group("b", 2))
    first = buf.try_get_batch(2, 0)
    second = buf.try_get_batch(2, 0)
    assert (first.batch_id, second.batch_id) == (1, 2)
    assert buf.ack_batch(1).status == AckStatus.ACKED
    served = metrics.SERVED._value.get()
    for _ in range(2):
        r = buf.ack_batch(1)
        assert (r.status, r.trajectories) == (AckStatus.ALREADY_ACKED, 0)
    assert buf.ack_batch(0).status == AckStatus.UNKNOWN
    assert buf.ack_batch(3).status == AckStatus.UNKNOWN  # not issued yet
    buf.configure(tau=None, drop_unserved=True)  # releases batch 2, unacked
    r = buf.ack_batch(2)
    assert r.status == AckStatus.RELEASED and "discarded" in r.detail
    st = buf.status()
    assert (st.served, st.batches_acked, st.dropped_other, st.leased) == (2, 1, 2, 0)
    assert metrics.SERVED._value.get() == served
    buf.close()
    buf = _open(tmp_path, group_size=2)  # the answers survive a restart
    assert [buf.ack_batch(i).status for i in (1, 2, 3)] == [
        AckStatus.ALREADY_ACKED, AckStatus.RELEASED, AckStatus.UNKNOWN]
    assert buf.status() == st
    buf.close()


def test_unacked_batch_is_served_again_after_the_lease_timeout(tmp_path: Path) -> None:
    buf = _open(tmp_path, group_size=2, lease_timeout=0.3)
    buf.put(synthetic_group("a", 2, rewards=[1.0, 0.0]) + synthetic_group("b", 2))
    start = time.monotonic()  # before the lease: it cannot run out sooner than 0.3 s after
    first = buf.try_get_batch(2, 0)
    assert (first.batch_id, first.delivery) == (1, 1)
    # Still leased: the next batch is a new one.
    second = buf.try_get_batch(2, 0)
    assert second.batch_id == 2 and _ids(second) == ["b/0", "b/1"]
    assert buf.try_get_batch(2, 0).trajectories == []
    # A blocking get wakes when the lease runs out, with no Put to wake it (long before its
    # own timeout, however loaded the machine).
    again = buf.get_batch(2, 0, timeout=120)
    assert 0.29 <= time.monotonic() - start < 60
    assert (again.batch_id, again.delivery) == (1, 2)
    assert _ids(again) == _ids(first)
    assert [t.reward for t in again.trajectories] == [1.0, 0.0]  # as it was put
    # Batch 2 ran out meanwhile too; acking it late still counts while nobody took it again.
    assert buf.ack_batch(2).status == AckStatus.ACKED
    assert buf.ack_batch(1).status == AckStatus.ACKED
    st = buf.status()
    assert (st.served, st.leased, st.redeliveries, st.batches) == (4, 0, 1, 2)
    buf.close()


def test_lease_from_before_a_restart_is_served_again_first(tmp_path: Path) -> None:
    buf = _open(tmp_path, group_size=2)  # default lease timeout: only the restart frees it
    buf.put(synthetic_group("a", 2) + synthetic_group("b", 2) + synthetic_group("c", 2))
    lost = buf.try_get_batch(4, 0)  # the answer never reaches the trainer
    done = buf.try_get_batch(2, 0)
    buf.ack_batch(done.batch_id)
    buf.close()

    buf = _open(tmp_path, group_size=2)
    st = buf.status()
    assert (st.leased, st.leases, st.depth, st.served, st.batches) == (4, 1, 0, 2, 2)
    buf.put(synthetic_group("d", 2, version=0))
    again = buf.try_get_batch(8, 0)  # before any new batch, and not topped up with d
    assert (again.batch_id, again.delivery) == (lost.batch_id, 2)
    assert _ids(again) == _ids(lost) == ["a/0", "a/1", "b/0", "b/1"]
    new = buf.try_get_batch(2, 0)
    assert (new.batch_id, new.delivery, _ids(new)) == (3, 1, ["d/0", "d/1"])
    buf.close()

    # Restarted again before either ack: both come back, oldest id first, counting deliveries.
    buf = _open(tmp_path, group_size=2)
    b1, b2 = buf.try_get_batch(4, 0), buf.try_get_batch(4, 0)
    assert [(b.batch_id, b.delivery) for b in (b1, b2)] == [(lost.batch_id, 3), (3, 2)]
    for b in (b1, b2):
        assert buf.ack_batch(b.batch_id).status == AckStatus.ACKED
    buf.close()
    buf = _open(tmp_path, group_size=2)
    st = buf.status()
    assert (st.depth, st.leased, st.served, st.accepted, st.redeliveries) == (0, 0, 8, 8, 3)
    assert buf.try_get_batch(8, 0, allow_partial=True).trajectories == []
    buf.close()


def test_freshness_applies_when_a_batch_is_served_again(tmp_path: Path) -> None:
    buf = _open(tmp_path, group_size=2, tau=1)
    buf.put(synthetic_group("a", 2, version=0) + synthetic_group("b", 2, version=1))
    held = buf.try_get_batch(4, 1)
    # A batch the trainer holds is not swept when the version moves on: it may be training on it.
    buf.set_policy_version(2)
    assert buf.status().leased == 4
    buf.close()

    buf = _open(tmp_path, group_size=2, tau=1)
    stale0 = metrics.DROPPED_STALE._value.get()
    again = buf.try_get_batch(4, 2)  # a is now 2 behind: dropped; b goes out as batch 1
    assert (again.batch_id, again.delivery, _ids(again)) == (held.batch_id, 2, ["b/0", "b/1"])
    assert again.staleness == [1, 1]
    assert metrics.DROPPED_STALE._value.get() - stale0 == 2
    st = buf.status()
    assert (st.dropped_stale, st.leased) == (2, 2)
    buf.put(synthetic_group("c", 2, version=2))
    assert buf.try_get_batch(2, 2).batch_id == 2
    buf.close()

    # Batch 1 is served again at version 2, then the buffer restarts with the trainer at 5:
    # nothing in either batch is fresh, so both are released and their ids retired.
    buf = _open(tmp_path, group_size=2, tau=1)
    assert buf.try_get_batch(4, 2).batch_id == 1
    buf.close()
    buf = _open(tmp_path, group_size=2, tau=1)
    assert buf.try_get_batch(4, 5, allow_partial=True).trajectories == []
    for batch_id in (1, 2):
        r = buf.ack_batch(batch_id)
        assert r.status == AckStatus.RELEASED and "stale" in r.detail
    st = buf.status()
    assert (st.dropped_stale, st.leased, st.leases, st.served) == (6, 0, 0, 0)
    buf.close()
    buf = _open(tmp_path, group_size=2, tau=1)
    assert buf.status() == st
    buf.close()


def test_a_batch_that_no_longer_fits_returns_to_the_pool(tmp_path: Path) -> None:
    buf = _open(tmp_path, group_size=2)
    buf.put(synthetic_group("a", 2) + synthetic_group("b", 2))
    big = buf.try_get_batch(4, 0)
    buf.close()
    buf = _open(tmp_path, group_size=2)
    # The trainer now asks for 2 at a time: batch 1 is released and its groups re-batched.
    first = buf.try_get_batch(2, 0)
    second = buf.try_get_batch(2, 0)
    assert [(b.batch_id, b.delivery) for b in (first, second)] == [(2, 1), (3, 1)]
    assert sorted(_ids(first) + _ids(second)) == _ids(big)
    r = buf.ack_batch(big.batch_id)
    assert r.status == AckStatus.RELEASED and "resized" in r.detail
    for b in (first, second):
        assert buf.ack_batch(b.batch_id).status == AckStatus.ACKED
    st = buf.status()
    assert (st.served, st.leased, st.depth, st.dropped_other) == (4, 0, 0, 0)
    buf.close()


def test_put_of_a_leased_trajectory_is_a_duplicate(tmp_path: Path) -> None:
    buf = _open(tmp_path, group_size=2)
    g = synthetic_group("a", 2)
    buf.put(g)
    batch = buf.try_get_batch(2, 0)
    r = buf.put(g)  # a rollout retrying after a lost acknowledgement
    assert (r.accepted, r.duplicates) == (0, 2)
    buf.ack_batch(batch.batch_id)
    assert buf.put(g).duplicates == 2
    assert buf.try_get_batch(2, 0).trajectories == []
    buf.close()
