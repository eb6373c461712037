"""Groups and freshness control, in the pure helpers and end to end through a real
TrajectoryBuffer on a temporary directory. (Group advantages are the trainer's:
test_advantages.py.)"""
from __future__ import annotations

import random
from pathlib import Path

import pytest

from kiln.freshness import is_stale
from kiln.services.buffer import groups as G
from kiln.services.buffer.buffer import TrajectoryBuffer
from kiln.services.buffer.types import BufferConfig, InvalidTrajectory
from kiln.services.buffer.synthetic import synthetic_group, synthetic_trajectory
from kiln.services.common import metrics
from kiln.trajectory import VersionSpan


def _open(path: Path, **kw) -> TrajectoryBuffer:
    return TrajectoryBuffer.open(path, BufferConfig(**kw))


def test_freshness_rule_boundary() -> None:
    assert not is_stale(10, 8, tau=2)   # exactly tau behind: kept
    assert is_stale(10, 7, tau=2)       # tau + 1 behind: dropped
    assert not is_stale(10, 0, tau=None)
    assert not is_stale(3, 3, tau=0) and is_stale(4, 3, tau=0)


def test_pick_groups_oldest_first_and_whole() -> None:
    def grp(key: str, n: int, version: int, seq: int) -> G.Group:
        g = G.Group(key, n, seq)
        g.members = [G.Entry(f"{key}{i}", key, version, b"") for i in range(n)]
        return g

    a, b, c = grp("a", 4, 5, 1), grp("b", 4, 3, 2), grp("c", 2, 5, 0)
    # b is oldest; then c would leave room for nothing ready, so a, which fills the batch.
    assert [g.key for g in G.pick_groups([a, b, c], 8)] == ["b", "a"]
    assert [g.key for g in G.pick_groups([a, b, c], 10)] == ["b", "c", "a"]
    assert [g.key for g in G.pick_groups([a, b, c], 7)] == ["b", "c"]  # no exact fill: greedy
    assert G.pick_groups([a], 3) == []


def test_a_small_group_at_the_head_does_not_wedge_batches() -> None:
    """A group of 2 ahead of groups of 8 (a stage with groupSize 8): the greedy pick would take
    it and never fill a batch of 16; the exact pick serves the groups of 8 and leaves it."""
    head = G.Group("small", 2, 0)
    head.members = [G.Entry(f"s{i}", "small", 0, b"") for i in range(2)]
    eights = []
    for k in range(1, 5):
        g = G.Group(f"g{k}", 8, k)
        g.members = [G.Entry(f"g{k}-{i}", g.key, 1, b"") for i in range(8)]
        eights.append(g)
    assert [g.key for g in G.pick_groups([head, *eights], 16)] == ["g1", "g2"]
    # A partner for it makes it servable again, oldest first.
    pair = G.Group("pair", 6, 9)
    pair.members = [G.Entry(f"p{i}", "pair", 0, b"") for i in range(6)]
    assert [g.key for g in G.pick_groups([head, pair, *eights], 16)] == ["small", "pair", "g1"]


def test_a_group_is_served_once_complete_and_as_it_was_put(tmp_path: Path) -> None:
    buf = _open(tmp_path, group_size=4)
    trajs = synthetic_group("g", 4, rewards=[1.0, 0.0, 1.0, 1.0])
    buf.put(trajs[:3])
    assert buf.status().groups_pending == 1 and buf.status().ready == 0
    assert buf.try_get_batch(4, 0).trajectories == []
    buf.put(trajs[3:])
    batch = buf.try_get_batch(4, 0)
    assert [t.id for t in batch.trajectories] == [t.id for t in trajs]
    # What was put, rewards and all: the trainer takes the group's advantages from them.
    assert batch.trajectories == trajs
    buf.close()


def test_sft_trajectories_are_groups_of_one(tmp_path: Path) -> None:
    buf = _open(tmp_path)  # group size 1, no tau
    buf.put([synthetic_trajectory(f"s{i}", reward=float(i), version=0) for i in range(3)])
    buf.set_policy_version(1000)  # no tau: nothing is ever stale
    batch = buf.try_get_batch(3, 1000)
    assert [t.group_key for t in batch.trajectories] == ["\0s0", "\0s1", "\0s2"]
    assert batch.staleness == [1000, 1000, 1000]
    buf.close()


def test_stale_on_arrival_is_dropped(tmp_path: Path) -> None:
    buf = _open(tmp_path, group_size=2, tau=1)
    buf.set_policy_version(5)
    before = metrics.DROPPED_STALE._value.get()
    r = buf.put(synthetic_group("old", 2, version=3) + synthetic_group("ok", 2, version=4))
    assert (r.accepted, r.dropped_stale, r.depth) == (4, 2, 2)
    assert metrics.DROPPED_STALE._value.get() - before == 2
    assert [t.group_id for t in buf.try_get_batch(2, 5).trajectories] == ["ok", "ok"]
    buf.close()


def test_partly_stale_group_is_dropped_whole(tmp_path: Path) -> None:
    buf = _open(tmp_path, group_size=3, tau=2)
    buf.set_policy_version(4)
    fresh = synthetic_group("g", 3, version=4)
    buf.put(fresh[:2])  # two fresh members wait for the third
    late = synthetic_trajectory("g/2", "g", version=1)  # 4 - 1 > 2
    r = buf.put([late])
    assert r.dropped_stale == 3 and r.depth == 0
    st = buf.status()
    assert st.dropped_stale == 3 and st.groups_pending == 0
    # The group stays closed: a fourth member is accepted and dropped, never served.
    r = buf.put([synthetic_trajectory("g/3", "g", version=4)])
    assert (r.accepted, r.dropped_stale, r.depth) == (1, 1, 0)
    buf.close()


def test_version_advance_drops_ready_and_pending(tmp_path: Path) -> None:
    buf = _open(tmp_path, group_size=2, tau=1)
    buf.put(synthetic_group("v0", 2, version=0))
    buf.put(synthetic_group("v1", 2, version=1)[:1])  # pending
    buf.put(synthetic_group("v2", 2, version=2))
    st = buf.set_policy_version(2)  # v0 is 2 behind
    assert (st.dropped_stale, st.depth, st.groups_pending) == (2, 3, 1)
    st = buf.set_policy_version(3)  # v1 is 2 behind too, even though incomplete
    assert (st.dropped_stale, st.depth, st.groups_pending) == (3, 2, 0)
    assert metrics.POLICY_VERSION.labels("buffer")._value.get() == 3
    buf.close()


def test_get_batch_applies_freshness_with_its_version(tmp_path: Path) -> None:
    buf = _open(tmp_path, group_size=2, tau=2)
    buf.put(synthetic_group("a", 2, version=0) + synthetic_group("b", 2, version=3))
    batch = buf.try_get_batch(2, 3)  # a is 3 behind
    assert [t.group_id for t in batch.trajectories] == ["b", "b"]
    assert batch.staleness == [0, 0]
    assert buf.status().dropped_stale == 2
    buf.close()


def test_mixed_versions_use_the_oldest(tmp_path: Path) -> None:
    buf = _open(tmp_path, group_size=1, tau=1)
    t = synthetic_trajectory("x", tokens=40, version=5)
    t.version_spans = [VersionSpan(s.start, s.end, 3 if i == 0 else 5)
                       for i, s in enumerate(t.version_spans)]
    assert t.oldest_version == 3
    buf.put([t])
    batch = buf.try_get_batch(1, 5)  # 5 - 3 > 1
    assert batch.trajectories == [] and buf.status().dropped_stale == 1
    buf.close()


def test_group_membership_errors(tmp_path: Path) -> None:
    buf = _open(tmp_path, group_size=2)
    g = synthetic_group("g", 2)
    buf.put(g[:1])
    with pytest.raises(InvalidTrajectory, match="started with group size 2"):
        buf.put(g[1:], group_size=3)
    buf.put(g[1:])
    with pytest.raises(InvalidTrajectory, match="already has all its members"):
        buf.put([synthetic_trajectory("g/9", "g")])
    with pytest.raises(InvalidTrajectory, match="more than its 2 members"):
        buf.put(synthetic_group("h", 3))
    with pytest.raises(InvalidTrajectory, match="group_id is empty"):
        buf.put([synthetic_trajectory("lonely")])
    assert buf.status().accepted == 2
    buf.close()


def test_per_put_group_size(tmp_path: Path) -> None:
    buf = _open(tmp_path, group_size=4)
    buf.put(synthetic_group("pair", 2), group_size=2)
    assert len(buf.try_get_batch(2, 0).trajectories) == 2
    # A group larger than the batch can never be served: it is dropped, not left to stop the
    # groups behind it.
    buf.put(synthetic_group("quad", 4))
    buf.put(synthetic_group("pair2", 2), group_size=2)
    assert [t.group_id for t in buf.try_get_batch(2, 0).trajectories] == ["pair2", "pair2"]
    assert buf.status().dropped_other == 4
    buf.close()


def test_the_wedge_a_group_of_2_ahead_of_groups_of_8(tmp_path: Path) -> None:
    """A reward call of group_size 2 during a stage with groupSize 8 used to stop training: the
    buffer took the pair first and never filled a batch of 16."""
    buf = _open(tmp_path, group_size=8)
    buf.put(synthetic_group("pair", 2), group_size=2)
    for k in range(4):
        buf.put(synthetic_group(f"g{k}", 8))
    served = [buf.get_batch(16, 0, timeout=1.0) for _ in range(2)]
    assert [sorted({t.group_id for t in b.trajectories}) for b in served] == [["g0", "g1"], ["g2", "g3"]]
    buf.close()


def test_group_pool_keeps_its_member_count() -> None:
    rng = random.Random(0)
    pool = G.GroupPool()
    for step in range(500):
        key = f"g{rng.randrange(20)}"
        op = rng.random()
        if op < 0.5:
            group = G.Group(key, 4, step)
            group.members = [G.Entry(f"{key}-{step}-{i}", key, 0, b"") for i in range(rng.randrange(1, 5))]
            pool[key] = group  # a new key or a replacement
        elif op < 0.75 and key in pool:
            del pool[key]
        else:
            assert pool.pop(key, None) is None or key not in pool
        assert pool.members == sum(len(g.members) for g in pool.values())
    with pytest.raises(KeyError):
        pool.pop("absent")
    with pytest.raises(TypeError):
        pool.update({})


def test_a_group_larger_than_the_capacity_is_refused(tmp_path: Path) -> None:
    buf = _open(tmp_path, capacity=100)
    with pytest.raises(ValueError, match="group_size 4294967295 is larger than the buffer's capacity 100"):
        buf.put([synthetic_trajectory(f"g{i}", version=0) for i in range(300)], group_size=2**32 - 1)
    assert buf.status().depth == 0  # nothing admitted
    buf.close()
