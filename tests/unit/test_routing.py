"""The routed-experts record: packing round-trips, its size is the stated bound, and a trajectory
with one that does not fit is refused."""
from __future__ import annotations

import json

import numpy as np
import pytest

from kiln.routing import RoutedExperts, id_bits, packed_size
from kiln.trajectory import Trajectory, VersionSpan


@pytest.mark.parametrize("experts", [1, 2, 3, 8, 60, 64, 128, 257])
def test_pack_round_trips_at_every_width(experts: int) -> None:
    rng = np.random.default_rng(experts)
    ids = rng.integers(0, experts, size=(37, 3, 2))
    r = RoutedExperts.pack(ids, experts, start=4)
    assert np.array_equal(r.unpack(), ids)
    assert len(r.packed) == packed_size(37, 3, 2, experts) == -(-37 * 3 * 2 * id_bits(experts) // 8)
    assert RoutedExperts.from_dict(json.loads(json.dumps(r.to_dict()))) == r


def test_size_bound_per_token() -> None:
    # The tiny test model: 2 layers, top-2 of 8 experts -> 12 bits a token.
    assert packed_size(1000, 2, 2, 8) == 1500
    # A Qwen3-30B-A3B-like model: 48 layers, top-8 of 128 -> 336 bytes a token, a quarter of int32.
    assert packed_size(1, 48, 8, 128) == 336
    assert packed_size(32768, 48, 8, 128) < 48 * 8 * 4 * 32768 / 3.9


def test_out_of_range_ids_and_bad_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match=r"expert ids must be in \[0, 8\)"):
        RoutedExperts.pack([[[8, 0]]], 8)
    broken = RoutedExperts(layers=2, topk=2, num_experts=8, start=0, rows=10, packed=b"\0" * 3)
    with pytest.raises(ValueError, match="expected 15"):
        broken.unpack()


def _traj(routed: RoutedExperts | None) -> Trajectory:
    return Trajectory(id="t", task_id="x", group_id="g", tokens=[1, 2, 3, 4], loss_mask=[0, 0, 1, 1],
                      logp_infer=[0, 0, -1, -1], version_spans=[VersionSpan(2, 4, 0)], routed_experts=routed)


def test_trajectory_checks_the_routing_it_carries() -> None:
    ok = _traj(RoutedExperts.pack(np.zeros((3, 2, 2), dtype=int), 8))
    ok.check()
    assert Trajectory.from_dict(json.loads(json.dumps(ok.to_dict()))) == ok
    with pytest.raises(ValueError, match=r"cover positions \[2, 5\)"):
        _traj(RoutedExperts.pack(np.zeros((3, 2, 2), dtype=int), 8, start=2)).check()
    with pytest.raises(ValueError, match="packed bytes"):
        _traj(RoutedExperts(layers=2, topk=2, num_experts=8, start=0, rows=3, packed=b"")).check()


def test_merge_keeps_earlier_positions_and_takes_the_newest_from_where_it_starts() -> None:
    from kiln.routing import merge_routing

    first = RoutedExperts.pack([[[1, 2]], [[1, 2]], [[1, 2]]], 8, start=0)      # positions 0..2
    cached = RoutedExperts.pack([[[3, 4]], [[3, 4]]], 8, start=2)                # 2..3, prefix cached
    merged = merge_routing(first, cached)
    assert (merged.start, merged.rows) == (0, 4)
    assert merged.unpack()[:, 0].tolist() == [[1, 2], [1, 2], [3, 4], [3, 4]]
    whole = RoutedExperts.pack([[[5, 6]]] * 5, 8, start=0)                     # recomputed all
    assert merge_routing(merged, whole) == whole
    gap = RoutedExperts.pack([[[7, 0]]], 8, start=6)
    assert merge_routing(merged, gap) == gap
    assert merge_routing(None, first) == first and merge_routing(first, None) == first


def test_rows_carry_the_version_they_were_routed_under_through_merge_and_json() -> None:
    from kiln.routing import merge_routing

    first = RoutedExperts.pack([[[1, 2]]] * 3, 8, start=0, version=4)   # rows 0..2 under v4
    cached = RoutedExperts.pack([[[3, 4]]] * 2, 8, start=2, version=5)  # rows 2..3 under v5
    merged = merge_routing(first, cached)
    assert merged.versions == ((0, 4), (2, 5))
    assert [merged.version_at(p) for p in range(4)] == [4, 4, 5, 5]
    assert RoutedExperts.from_dict(merged.to_dict()) == merged
    unversioned = RoutedExperts.pack([[[1, 2]]], 8)
    assert unversioned.versions == () and unversioned.version_at(0) is None
    old3 = RoutedExperts.pack([[[1, 2]]] * 3, 8)
    assert merge_routing(old3, cached).versions == ()  # an unknown part: none claimed
    # A record written before versions existed still loads.
    legacy = {k: v for k, v in first.to_dict().items() if k != "versions"}
    assert RoutedExperts.from_dict(legacy).versions == ()


def test_straddled_positions_by_hand() -> None:
    """Tokens 3..5 sampled under v0, 6..9 under v1; the engine recomputed the context under v1
    and kept that routing for every row: tokens 3..5 (predicted from rows 2..4, routed under v1)
    straddle, tokens 6..9 do not. With rows 0..4 kept from a v0 pass (a prefix cache), nothing
    straddles."""
    from kiln.routing import straddled_positions
    from kiln.trajectory import VersionSpan

    spans = [VersionSpan(3, 6, 0), VersionSpan(6, 10, 1)]
    recomputed = RoutedExperts.pack([[[1, 2]]] * 9, 8, start=0, version=1)
    assert straddled_positions(recomputed, spans) == [3, 4, 5]
    import dataclasses
    cached = dataclasses.replace(recomputed, versions=((0, 0), (5, 1)))
    assert straddled_positions(cached, spans) == []
    assert straddled_positions(RoutedExperts.pack([[[1, 2]]] * 9, 8), spans) == []
    assert straddled_positions(None, spans) == []
