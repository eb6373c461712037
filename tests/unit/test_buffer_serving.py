"""TrajectoryBuffer on a temporary directory: idempotence, validation, backpressure, blocking
GetBatch, metrics, and what survives a restart (nothing acknowledged lost, nothing acked served
again). Leases and acks in detail: test_buffer_leases.py."""
from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from kiln.services.buffer import records
from kiln.services.buffer.buffer import TrajectoryBuffer
from kiln.services.buffer.types import BufferConfig, BufferFull, InvalidTrajectory
from kiln.services.buffer.synthetic import synthetic_group, synthetic_trajectory
from kiln.services.common import metrics


def _open(path: Path, **kw) -> TrajectoryBuffer:
    return TrajectoryBuffer.open(path, BufferConfig(**kw))


def _hist_count(h) -> float:
    return next(s.value for s in h.collect()[0].samples if s.name.endswith("_count"))


def test_duplicate_put_is_acknowledged_and_stored_once(tmp_path: Path) -> None:
    buf = _open(tmp_path, group_size=2)
    g = synthetic_group("g", 2)
    before = metrics.ACCEPTED._value.get()
    assert buf.put(g).accepted == 2
    r = buf.put(g + [g[0]])
    assert (r.accepted, r.duplicates, r.depth) == (0, 3, 2)
    assert metrics.ACCEPTED._value.get() - before == 2
    buf.ack_batch(buf.try_get_batch(2, 0).batch_id)
    r = buf.put(g)  # already trained on: still a duplicate, never served again
    assert (r.accepted, r.duplicates, r.depth) == (0, 2, 0)
    buf.close()
    buf = _open(tmp_path, group_size=2)  # and after a restart
    assert buf.put(g).duplicates == 2 and buf.status().depth == 0
    buf.close()


def test_malformed_record_rejects_the_whole_put(tmp_path: Path) -> None:
    buf = _open(tmp_path)
    good = synthetic_trajectory("good")
    bad = synthetic_trajectory("bad")
    bad.logp_infer = bad.logp_infer[:-1]
    with pytest.raises(InvalidTrajectory) as err:
        buf.put([good, bad])
    assert err.value.trajectory_id == "bad" and "same length" in err.value.reason
    assert buf.status().depth == 0  # nothing from that Put was stored
    nan = synthetic_trajectory("nan", reward=float("nan"))
    with pytest.raises(InvalidTrajectory, match="reward is nan"):
        buf.put([nan])
    neg = synthetic_trajectory("neg")
    neg.tokens[0] = -5
    with pytest.raises(InvalidTrajectory, match="'neg'"):
        buf.put([neg])
    assert buf.put([good]).accepted == 1
    buf.close()


def test_backpressure_refuses_new_groups_only(tmp_path: Path) -> None:
    buf = _open(tmp_path, group_size=2, capacity=4)
    a, b, c = (synthetic_group(k, 2) for k in "abc")
    buf.put(a + b[:1])
    buf.put(b[1:] + c[:1])  # depth 3 < 4: the whole Put is taken, now 5
    with pytest.raises(BufferFull, match="capacity"):
        buf.put(synthetic_group("d", 2))
    assert buf.put(c[1:]).accepted == 1  # completes a started group: over capacity is fine
    assert buf.status().depth == 6
    assert buf.put(a).duplicates == 2  # duplicates are acknowledged even when full
    batch = buf.try_get_batch(4, 0)
    # Leased trajectories still count against capacity until the trainer acks them.
    with pytest.raises(BufferFull, match=r"2 waiting, 4 leased"):
        buf.put(synthetic_group("d", 2))
    buf.ack_batch(batch.batch_id)
    assert buf.put(synthetic_group("d", 2)).accepted == 2
    buf.close()


def test_byte_capacity_bounds_what_is_held_in_memory(tmp_path: Path) -> None:
    """Capacity in bytes as well as in count: a few big trajectories fill the buffer long
    before the count does; acked bytes are freed; a Put bigger than the whole capacity is
    refused for good (ValueError), not told to retry; the status reports both."""
    from kiln.services.common import codec
    size = {k: sum(len(codec.to_bytes(t)) for t in synthetic_group(k, 2)) for k in "abc"}
    limit = size["a"] + size["b"] + size["c"] - 1
    buf = _open(tmp_path, group_size=2, capacity=1000, capacity_bytes=limit)
    buf.put(synthetic_group("a", 2))
    buf.put(synthetic_group("b", 2))
    assert buf.status().unconsumed_bytes == size["a"] + size["b"]
    with pytest.raises(BufferFull, match="byte capacity"):
        buf.put(synthetic_group("c", 2))
    batch = buf.try_get_batch(2, 0)
    assert {t.group_id for t in batch.trajectories} == {"a"}
    with pytest.raises(BufferFull, match="byte capacity"):  # leased bytes still count
        buf.put(synthetic_group("c", 2))
    buf.ack_batch(batch.batch_id)
    assert buf.put(synthetic_group("c", 2)).accepted == 2
    assert (buf.status().unconsumed_bytes, buf.status().capacity_bytes) == \
        (size["b"] + size["c"], limit)
    one = len(codec.to_bytes(synthetic_trajectory("huge")))
    big = _open(tmp_path / "big", group_size=1, capacity_bytes=one // 2)
    with pytest.raises(ValueError, match="whole byte capacity"):
        big.put([synthetic_trajectory("huge")])
    big.close()
    buf.close()


def test_unconsumed_bytes_is_kept_as_entries_come_and_go(tmp_path: Path) -> None:
    """The byte count is kept as entries are filed, dropped and consumed, not rescanned per Put:
    after every kind of change it equals a scan of the groups not consumed, and a restart
    rebuilds the same figure."""
    def scanned(b: TrajectoryBuffer) -> int:
        return sum(len(e.payload) for g in b.index.unserved_groups() for e in g.members)

    buf = _open(tmp_path, group_size=2, tau=1)
    steps = [
        lambda: buf.put(synthetic_group("a", 2)),
        lambda: buf.put(synthetic_group("b", 2)),
        lambda: buf.put(synthetic_group("half", 2)[:1]),          # an incomplete group
        lambda: buf.put(synthetic_group("old", 2, version=0)),
        lambda: buf.ack_batch(buf.try_get_batch(2, 0).batch_id),  # consumed
        lambda: buf.try_get_batch(2, 0),                          # leased: still held
        lambda: buf.set_policy_version(2),                        # version 0 is now stale
        lambda: buf.put(synthetic_group("c", 2, version=2)),
        lambda: buf.put(synthetic_group("d", 2, version=2)),
        lambda: buf.configure(tau=1, drop_unserved=True),         # everything discarded
        lambda: buf.put(synthetic_group("e", 2, version=2)),
    ]
    seen = set()
    for step in steps:
        step()
        seen.add(buf.status().unconsumed_bytes)
        assert buf.status().unconsumed_bytes == scanned(buf)
    assert len(seen) > 3  # the figure moved both ways
    held = buf.status().unconsumed_bytes
    buf.close()
    buf = _open(tmp_path, group_size=2, tau=1)
    assert buf.status().unconsumed_bytes == held == scanned(buf) > 0
    buf.close()


def test_get_batch_waits_for_a_put_in_another_thread(tmp_path: Path) -> None:
    buf = _open(tmp_path, group_size=2)
    start = time.monotonic()  # before the timer: the put comes no sooner than 0.2 s after
    late = threading.Timer(0.2, lambda: buf.put(synthetic_group("late", 2)))
    late.start()
    batch = buf.get_batch(2, 0, timeout=120)
    assert 0.19 <= time.monotonic() - start < 60  # woken by the put, not by its timeout
    late.join()
    assert len(batch.trajectories) == 2 and batch.batch_id == 1
    buf.close()


def test_get_batch_timeout_and_partial(tmp_path: Path) -> None:
    buf = _open(tmp_path, group_size=2)
    buf.put(synthetic_group("a", 2) + synthetic_group("b", 2)[:1])
    start = time.monotonic()
    assert buf.get_batch(4, 0, timeout=0.2).trajectories == []
    assert time.monotonic() - start >= 0.2
    batch = buf.get_batch(4, 0, timeout=0.05, allow_partial=True)
    assert [t.group_id for t in batch.trajectories] == ["a", "a"]  # whole groups only
    with pytest.raises(ValueError, match="size must be >= 1"):
        buf.try_get_batch(0, 0)
    buf.close()


def test_serving_metrics(tmp_path: Path) -> None:
    buf = _open(tmp_path, group_size=2, tau=3)
    served0, hist0 = metrics.SERVED._value.get(), _hist_count(metrics.STALENESS)
    buf.put(synthetic_group("a", 2, version=1) + synthetic_group("b", 2, version=2))
    assert metrics.BUFFER_DEPTH._value.get() == 4
    batch = buf.try_get_batch(4, 3)
    assert batch.staleness == [2, 2, 1, 1]  # oldest group first
    assert metrics.BUFFER_DEPTH._value.get() == 0
    # Served and staleness count trained-on trajectories: at the ack, once.
    assert metrics.SERVED._value.get() - served0 == 0
    buf.ack_batch(batch.batch_id)
    buf.ack_batch(batch.batch_id)
    assert metrics.SERVED._value.get() - served0 == 4
    assert _hist_count(metrics.STALENESS) - hist0 == 4
    assert metrics.BUFFER_DEPTH._value.get() == 0
    st = buf.status()
    assert (st.served, st.batches, st.max_staleness, st.policy_version) == (4, 1, 2, 3)
    buf.close()


def test_restart_keeps_unserved_and_forgets_served(tmp_path: Path) -> None:
    buf = _open(tmp_path, group_size=2, tau=4)
    groups = [synthetic_group(f"g{i}", 2, version=i, rewards=[float(i), 0.0]) for i in range(5)]
    for g in groups:
        buf.put(g)
    buf.put(synthetic_group("half", 2, version=4)[:1])
    first = buf.try_get_batch(4, 4)
    buf.ack_batch(first.batch_id)
    buf.close()

    buf = _open(tmp_path, group_size=2, tau=4)
    st = buf.status()
    assert (st.depth, st.ready, st.groups_pending, st.served, st.policy_version) == (7, 6, 1, 4, 4)
    buf.put(synthetic_group("half", 2, version=4)[1:])
    rest = buf.try_get_batch(8, 4)
    buf.ack_batch(rest.batch_id)
    served = [t.id for t in first.trajectories + rest.trajectories]
    assert len(served) == len(set(served)) == 12
    # Whole groups come back with their stored rewards (the trainer's advantages' inputs).
    by_id = {t.id: t.reward for t in rest.trajectories}
    assert by_id["g4/0"] == 4.0 and by_id["g4/1"] == 0.0 and {"half/0", "half/1"} <= set(by_id)
    assert rest.batch_id == 2
    buf.close()


def test_torn_put_after_crash_is_not_recovered(tmp_path: Path) -> None:
    buf = _open(tmp_path, group_size=1)
    buf.put([synthetic_trajectory("kept")])
    seg = buf.store.segment_files()[-1]
    buf.close()
    # A crash halfway through writing the next Put: its caller never got an acknowledgement.
    from kiln.protos.kiln.v1 import buffer_pb2
    from kiln.services.common import codec
    rec = buffer_pb2.BufferRecord(id="torn", trajectory=codec.to_bytes(synthetic_trajectory("torn")),
                                  group_size=1)
    with open(seg, "ab") as f:
        f.write(records.encode(1, rec.SerializeToString())[:30])
    buf = _open(tmp_path, group_size=1)
    assert buf.status().depth == 1
    assert buf.put([synthetic_trajectory("torn")]).accepted == 1  # the client's retry
    assert [t.id for t in buf.try_get_batch(2, 0).trajectories] == ["kept", "torn"]
    buf.close()


def test_counters_survive_side_log_snapshots(tmp_path: Path) -> None:
    cfg = dict(group_size=2, tau=1, side_log_bytes=300, segment_bytes=2000)
    buf = _open(tmp_path, **cfg)
    for i in range(20):
        buf.put(synthetic_group(f"g{i}", 2, version=i))
        if i % 3 == 0:
            buf.ack_batch(buf.try_get_batch(2, i).batch_id)
        if i % 7 == 0:
            buf.try_get_batch(2, i)  # left unacked: its lease must survive the snapshots
    st = buf.status()
    assert st.dropped_stale > 0 and st.served > 0 and st.leases > 0
    assert len(buf.store.segment_files()) < 10  # consumed segments were compacted
    buf.close()
    buf = _open(tmp_path, **cfg)
    again = buf.status()
    assert again == st
    assert buf.put(synthetic_group("g0", 2, version=0)).duplicates == 2
    buf.close()


def test_configure_is_durable_and_can_drain(tmp_path: Path) -> None:
    buf = _open(tmp_path, group_size=1)
    buf.put([synthetic_trajectory(f"sft{i}") for i in range(3)])
    st = buf.configure(group_size=4, tau=2, drop_unserved=True)
    assert (st.depth, st.dropped_other, st.dropped_stale, st.group_size, st.tau) == (0, 3, 0, 4, 2)
    buf.close()
    buf = _open(tmp_path, group_size=1)  # the job default loses to the recorded Configure
    st = buf.status()
    assert (st.group_size, st.tau, st.dropped_other) == (4, 2, 3)
    with pytest.raises(ValueError):
        buf.configure(tau=-1)
    st = buf.configure(tau=None)  # no bound (SFT data); the group size stays
    assert (st.group_size, st.tau) == (4, None)
    buf.close()
    buf = _open(tmp_path, group_size=1, tau=3)  # "no bound" is recorded, not a missing value
    assert (buf.status().group_size, buf.status().tau) == (4, None)
    buf.close()
