"""The edges of the buffer's record framing that decide whether acknowledged data is kept: a
record that ends exactly at the end of the file, garbage that is not a torn tail, files of the
old format (several records, a torn or damaged last one), and `kiln buffer repair`'s salvage
around damage. Each case here was a mutation of `records.py` that no other test noticed."""
from __future__ import annotations

import struct
import zlib

import pytest

from kiln.services.buffer import records


def v1(kind: int, payload: bytes) -> bytes:
    """A record of the old format (its header has no checksum of its own)."""
    crc = zlib.crc32(payload, zlib.crc32(struct.pack("<HI", kind, len(payload))))
    return struct.pack("<HHII", records.MAGIC_V1, kind, len(payload), crc) + payload


@pytest.mark.parametrize("encode", [records.encode, v1], ids=["current", "old"])
def test_a_last_record_that_ends_at_the_end_of_the_file_is_kept(encode) -> None:
    # An empty payload makes the record exactly its header: no torn tail, nothing to cut.
    for last in (b"", b"last"):
        data = encode(1, b"first") + encode(2, last)
        result = records.parse(data)
        assert [(k, p) for _, k, p in result.records] == [(1, b"first"), (2, last)]
        assert result.valid_end == len(data) and result.torn is False


def test_old_format_records_after_the_first_are_read_where_they_are() -> None:
    data = v1(1, b"one") + v1(2, b"two") + v1(1, b"three")
    assert [(o, k, p) for o, k, p in records.parse(data).records] == [
        (0, 1, b"one"), (len(v1(1, b"one")), 2, b"two"), (len(v1(1, b"one") + v1(2, b"two")), 1, b"three")]


def test_an_old_format_record_cut_short_or_zero_filled_is_a_torn_tail() -> None:
    good, last = v1(1, b"first"), v1(1, b"second record")
    cut = records.parse(good + last[:-3])
    assert cut.torn and cut.valid_end == len(good)
    # The header was written, the payload's blocks were not: zeros where it should be.
    zeroed = records.parse(good + last[:12] + b"\0" * (len(last) - 12))
    assert zeroed.torn and zeroed.valid_end == len(good)


def test_an_old_format_record_that_does_not_verify_before_more_data_is_damage() -> None:
    good, bad = v1(1, b"first"), bytearray(v1(1, b"second"))
    bad[-1] ^= 0xFF
    with pytest.raises(records.CorruptLog,
                       match=f"checksum mismatch at offset {len(good)} \\({len(bad) + 4} bytes "):
        records.parse(good + bytes(bad) + b"more")


@pytest.mark.parametrize("garbage", [b"XX", b"XXXXXXXXXXXXXXXXXXXX"])
def test_bytes_that_are_no_record_and_not_zeros_are_damage(garbage: bytes) -> None:
    good = records.encode(1, b"first")
    with pytest.raises(records.CorruptLog) as err:
        records.parse(good + garbage, "seg-1.log")
    assert str(err.value) == (
        f"seg-1.log: bad magic at offset {len(good)} ({len(garbage)} bytes from there to the end); "
        "not a torn tail: `kiln buffer check` reports, `kiln buffer repair` salvages")


def test_salvage_keeps_every_record_after_damage_and_ends_on_a_torn_tail() -> None:
    one, two, three, four = (records.encode(1, p) for p in (b"one", b"two", b"three", b"four"))
    damaged = bytearray(two)
    damaged[17] ^= 1
    # A stray byte before "four": the next record starts one byte after that damage.
    data = one + bytes(damaged) + three + b"\x01" + four + four[:7]
    found, damage = records.salvage(data)
    assert [p for _, _, p in found] == [b"one", b"three", b"four"]
    assert [(d.offset, d.problem) for d in damage] == [
        (len(one), "payload checksum mismatch"), (len(one + two + three), "bad magic")]
    # Damage with no record after it: what came before is kept.
    found, damage = records.salvage(one + b"\x01\x02\x03")
    assert [p for _, _, p in found] == [b"one"] and [d.offset for d in damage] == [len(one)]


def test_salvage_passes_over_a_magic_number_inside_damaged_bytes() -> None:
    # The damaged record's payload holds the magic number ("MK") at a place no record starts:
    # salvage probes it, finds no record there, and goes on to the next real one.
    one, two, three = (records.encode(1, p) for p in (b"one", b"two with MK inside", b"three"))
    damaged = bytearray(two)
    damaged[-1] ^= 1
    found, damage = records.salvage(one + bytes(damaged) + three)
    assert [p for _, _, p in found] == [b"one", b"three"]
    assert [(d.offset, d.problem) for d in damage] == [(len(one), "payload checksum mismatch")]
