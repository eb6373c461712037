"""The buffer's durable store: record framing, torn-tail recovery, consumption, compaction."""
from __future__ import annotations

from pathlib import Path

import pytest

from kiln.protos.kiln.v1 import buffer_pb2
from kiln.services.buffer import records
from kiln.services.buffer.store import StoreLocked, TrajectoryStore
from kiln.services.buffer.synthetic import synthetic_trajectory
from kiln.services.common import codec


def _rec(tid: str, group_size: int = 1) -> tuple[str, bytes, int]:
    return tid, codec.to_bytes(synthetic_trajectory(tid, tokens=40)), group_size


def _ids(recs: list[buffer_pb2.BufferRecord]) -> list[str]:
    # The store tracks ids without decoding; the bytes it hands back are the trajectory as put.
    assert all(codec.from_bytes(r.trajectory).id == r.id for r in recs)
    return [r.id for r in recs]


# ------------------------------------------------------------------------------------ framing


def test_records_parse_back() -> None:
    data = records.encode_many([(1, b"abc"), (2, b""), (1, b"x" * 1000)])
    result = records.parse(data)
    assert [(k, p) for _, k, p in result.records] == [(1, b"abc"), (2, b""), (1, b"x" * 1000)]
    assert result.valid_end == len(data) and not result.torn


@pytest.mark.parametrize("cut", [1, 5, 12, 13, 20])
def test_truncated_last_record_is_torn(cut: int) -> None:
    good = records.encode(1, b"first")
    last = records.encode(1, b"second record payload")
    result = records.parse(good + last[:cut])
    assert [p for _, _, p in result.records] == [b"first"]
    assert result.torn and result.valid_end == len(good)


def test_zero_filled_tail_is_torn() -> None:
    good = records.encode(1, b"first")
    result = records.parse(good + b"\0" * 64)
    assert result.torn and result.valid_end == len(good)


def test_bad_checksum_in_the_last_record_is_damage_not_a_torn_tail() -> None:
    # An intact header and a payload that does not verify: damage to an acknowledged record.
    good = records.encode(1, b"first")
    last = bytearray(records.encode(1, b"second"))
    last[-1] ^= 0xFF
    with pytest.raises(records.CorruptLog, match=f"payload checksum mismatch at offset {len(good)}"):
        records.parse(good + bytes(last))


def test_a_damaged_length_is_not_taken_for_the_end_of_the_file() -> None:
    good = records.encode(1, b"first")
    last = bytearray(records.encode(1, b"second"))
    last[4] ^= 0x40  # length 6 -> 70: past the end, but the header no longer verifies
    with pytest.raises(records.CorruptLog, match=f"header checksum mismatch at offset {len(good)}"):
        records.parse(good + bytes(last))


def test_old_format_files_are_still_read() -> None:
    import struct
    import zlib

    def v1(kind: int, payload: bytes) -> bytes:
        crc = zlib.crc32(payload, zlib.crc32(struct.pack("<HI", kind, len(payload))))
        return struct.pack("<HHII", records.MAGIC_V1, kind, len(payload), crc) + payload

    result = records.parse(v1(1, b"old") + records.encode(1, b"new"))
    assert [p for _, _, p in result.records] == [b"old", b"new"] and not result.torn


def test_salvage_skips_damage_and_keeps_the_rest() -> None:
    first, second, third = (records.encode(1, p) for p in (b"one", b"two", b"three"))
    damaged = bytearray(second)
    damaged[17] ^= 1  # in the payload
    found, damage = records.salvage(first + bytes(damaged) + third)
    assert [p for _, _, p in found] == [b"one", b"three"]
    assert [(d.offset, d.problem) for d in damage] == [(len(first), "payload checksum mismatch")]


def test_a_failed_write_leaves_the_file_as_it_was(tmp_path: Path, monkeypatch) -> None:
    import errno
    import os

    path = tmp_path / "log"
    with open(path, "ab") as f:
        records.append_durably(f, records.encode(1, b"kept"))
        real = os.write
        calls = []

        def short_then_enospc(fd, data):
            calls.append(len(data))
            if len(calls) == 1:
                return real(fd, bytes(data[:5]))  # part of the record reaches the disk
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(os, "write", short_then_enospc)
        with pytest.raises(OSError):
            records.append_durably(f, records.encode(1, b"refused"))
        monkeypatch.setattr(os, "write", real)
        # Space again: the next append lands right after the kept record, nothing in between.
        records.append_durably(f, records.encode(1, b"next"))
    assert [p for _, _, p in records.read_records(path).records] == [b"kept", b"next"]


def test_damage_in_the_middle_is_an_error() -> None:
    first = bytearray(records.encode(1, b"first"))
    first[-1] ^= 0xFF
    with pytest.raises(records.CorruptLog, match="checksum mismatch at offset 0"):
        records.parse(bytes(first) + records.encode(1, b"second"))


# -------------------------------------------------------------------------------------- store


def test_append_and_reopen(tmp_path: Path) -> None:
    store, rec = TrajectoryStore.open(tmp_path)
    assert rec.records == [] and rec.consumed == set()
    store.append([_rec("a", 2), _rec("b", 2)])
    store.append([_rec("c")])
    store.close()
    store, rec = TrajectoryStore.open(tmp_path)
    assert _ids(rec.records) == ["a", "b", "c"]
    assert [r.group_size for r in rec.records] == [2, 2, 1]
    assert codec.from_bytes(rec.records[0].trajectory) == synthetic_trajectory("a", tokens=40)
    store.close()


def test_consumed_ids_are_not_recovered(tmp_path: Path) -> None:
    store, _ = TrajectoryStore.open(tmp_path)
    store.append([_rec("a"), _rec("b"), _rec("c")])
    store.log_event({"t": "acked", "consumed": ["a", "c"]})
    store.close()
    store, rec = TrajectoryStore.open(tmp_path)
    assert _ids(rec.records) == ["b"]
    assert rec.consumed == {"a", "c"}
    assert rec.events == [{"t": "acked", "consumed": ["a", "c"]}]
    store.close()


def test_torn_segment_tail_is_truncated(tmp_path: Path) -> None:
    store, _ = TrajectoryStore.open(tmp_path)
    store.append([_rec("a"), _rec("b")])
    seg = store.segment_files()[-1]
    store.close()
    size = seg.stat().st_size
    tid, payload, group_size = _rec("c")
    partial = records.encode(1, buffer_pb2.BufferRecord(
        id=tid, trajectory=payload, group_size=group_size).SerializeToString())[:-7]
    with open(seg, "ab") as f:  # a crash in the middle of writing "c"
        f.write(partial)
    store, rec = TrajectoryStore.open(tmp_path)
    assert _ids(rec.records) == ["a", "b"]
    assert rec.truncated_bytes == len(partial)
    assert seg.stat().st_size == size
    store.append([_rec("d")])  # appends land after the cut, and read back
    store.close()
    store, rec = TrajectoryStore.open(tmp_path)
    assert _ids(rec.records) == ["a", "b", "d"]
    store.close()


def test_torn_side_log_tail_is_truncated(tmp_path: Path) -> None:
    store, _ = TrajectoryStore.open(tmp_path)
    store.append([_rec("a"), _rec("b")])
    store.log_event({"t": "acked", "consumed": ["a"]})
    store.close()
    with open(tmp_path / "side.log", "ab") as f:
        f.write(records.encode(2, b'{"t":"acked","consumed":["b"]}')[:-3])
    store, rec = TrajectoryStore.open(tmp_path)
    assert _ids(rec.records) == ["b"]  # the torn event never happened
    store.close()


def test_corrupt_segment_refuses_to_open(tmp_path: Path) -> None:
    store, _ = TrajectoryStore.open(tmp_path)
    store.append([_rec("a")])
    store.append([_rec("b")])
    seg = store.segment_files()[-1]
    store.close()
    data = bytearray(seg.read_bytes())
    data[20] ^= 0xFF  # inside the first record's payload
    seg.write_bytes(bytes(data))
    with pytest.raises(records.CorruptLog):
        TrajectoryStore.open(tmp_path)


def test_a_torn_record_in_a_segment_that_is_not_the_last_is_damage(tmp_path: Path) -> None:
    """Every segment but the last was fsync'd whole before the next was created, so a torn
    tail there is not a crash mid-write but lost acknowledged data: the store refuses to open
    and cuts nothing (truncating would drop "b" silently)."""
    store, _ = TrajectoryStore.open(tmp_path, segment_bytes=1)  # one Put per segment
    store.append([_rec("a"), _rec("b")])
    store.append([_rec("c")])
    first, last = store.segment_files()
    store.close()
    torn = first.read_bytes()[:-7]  # "b" loses its last bytes, as a torn write would leave it
    first.write_bytes(torn)
    with pytest.raises(records.CorruptLog, match="not the last"):
        TrajectoryStore.open(tmp_path, segment_bytes=1)
    assert first.read_bytes() == torn and last.stat().st_size > 0  # nothing repaired away
    # The refusal leaves the directory unlocked: opened again, it is refused for what it is.
    with pytest.raises(records.CorruptLog, match="not the last"):
        TrajectoryStore.open(tmp_path, segment_bytes=1)


def test_fully_consumed_segments_are_deleted(tmp_path: Path) -> None:
    store, _ = TrajectoryStore.open(tmp_path, segment_bytes=1)  # one Put per segment
    for i in range(4):
        store.append([_rec(f"{i}a"), _rec(f"{i}b")])
    assert len(store.segment_files()) == 4
    store.log_event({"t": "acked", "consumed": ["0a", "0b", "1a"]})
    names = [p.name for p in store.segment_files()]
    assert len(names) == 3 and "seg-0000000001.log" not in names
    store.log_event({"t": "acked", "consumed": ["1b", "2a", "2b", "3a", "3b"]})
    # The active segment is fully consumed too, so it rolled over to a fresh, empty one.
    assert [p.stat().st_size for p in store.segment_files()] == [0]
    store.append([_rec("e")])
    store.close()
    store, rec = TrajectoryStore.open(tmp_path)
    assert _ids(rec.records) == ["e"]
    assert {"0a", "3b"} <= rec.consumed
    store.close()


def test_side_log_snapshot_keeps_consumed_ids(tmp_path: Path) -> None:
    store, _ = TrajectoryStore.open(tmp_path, side_log_bytes=200)
    store.append([_rec(str(i)) for i in range(10)])
    for i in range(6):
        store.log_event({"t": "acked", "consumed": [str(i)]})
    assert store.needs_snapshot()
    store.snapshot({"version": 3})
    assert not store.needs_snapshot()
    store.log_event({"t": "acked", "consumed": ["6"]})
    store.close()
    store, rec = TrajectoryStore.open(tmp_path)
    assert _ids(rec.records) == ["7", "8", "9"]
    assert rec.events[0]["t"] == "snapshot" and rec.events[0]["version"] == 3
    assert len(rec.events) == 2
    store.close()


def test_one_process_per_directory(tmp_path: Path) -> None:
    store, _ = TrajectoryStore.open(tmp_path)
    with pytest.raises(StoreLocked):
        TrajectoryStore.open(tmp_path)
    store.close()
    TrajectoryStore.open(tmp_path)[0].close()
