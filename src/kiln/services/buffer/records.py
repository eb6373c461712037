"""Length-prefixed, checksummed records in append-only files, and recovery of a torn tail.

Layout of one record (little-endian):

    magic u16 (0x4B4D) | kind u16 | length u32 | payload crc32 u32 | header crc32 u32 | payload

The header carries its own checksum (of the 12 bytes before it), so a damaged length is known
for damage and never taken for the end of the file. Files written before that (magic 0x4B4C,
one CRC over kind, length and payload) are still read.

What counts as a torn tail, which recovery truncates: only what an interrupted append leaves,
never anything an acknowledged (fsync'd) record can become through damage:
- fewer bytes than a header at the end of the file, or nothing but zero bytes from some offset
  on (a filesystem that extended the file before a crash but did not write it);
- a record whose header is intact (checksum and all) but whose payload runs past the end of the
  file: the append was cut short.
Everything else that does not verify raises `CorruptLog` naming the file and offset, wherever it
is, including a payload checksum mismatch in the last record (a flipped bit there is damage to an
acknowledged record, not a torn write). `kiln buffer check` reports and `kiln buffer repair`
salvages such files.

Writes: `append_durably` writes with `os.write` and fsyncs; a write that fails (ENOSPC, EIO)
cuts the file back to where it was, so nothing of a failed, unacknowledged append stays behind
to reappear later.

Not covered here: what the payloads mean (`store.py`).
"""
from __future__ import annotations

import os
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Iterable

MAGIC = 0x4B4D
MAGIC_V1 = 0x4B4C
HEADER = struct.Struct("<HHIII")
HEADER_V1 = struct.Struct("<HHII")
MAX_RECORD_BYTES = 1 << 30


class CorruptLog(Exception):
    """A record that an append cannot have left behind is invalid. Restarting will not help: the
    file needs inspection (the path and offset are in the message; `kiln buffer check`)."""


def encode(kind: int, payload: bytes) -> bytes:
    head = struct.pack("<HHII", MAGIC, kind, len(payload), zlib.crc32(payload))
    return head + struct.pack("<I", zlib.crc32(head)) + payload


def encode_many(items: Iterable[tuple[int, bytes]]) -> bytes:
    return b"".join(encode(kind, payload) for kind, payload in items)


@dataclass
class ReadResult:
    records: list[tuple[int, int, bytes]]
    """(offset, kind, payload) of every valid record, in file order."""
    valid_end: int
    """Offset just past the last valid record: where a torn tail starts, or the file size."""
    torn: bool
    """True if bytes after `valid_end` were an incomplete record (to be truncated)."""


@dataclass
class Damage:
    offset: int
    problem: str


def _check(data: bytes, pos: int) -> tuple[int, int, int] | Damage | None:
    """At `pos`: (kind, payload start, end) of a valid record, Damage, or None for a torn tail."""
    size = len(data)
    rest = size - pos
    if rest < 2:
        return None  # one byte of an interrupted header
    magic = struct.unpack_from("<H", data, pos)[0]
    if magic not in (MAGIC, MAGIC_V1) and _zeros_from(data, pos):
        return None  # zero-filled tail
    if magic == MAGIC:
        if rest < HEADER.size:
            return None  # an interrupted header: no acknowledged record is this short
        _, kind, length, crc, head_crc = HEADER.unpack_from(data, pos)
        if zlib.crc32(data[pos:pos + 12]) != head_crc:
            return Damage(pos, "header checksum mismatch")
        start, end = pos + HEADER.size, pos + HEADER.size + length
        if end > size:
            return None  # an intact header, the payload cut short: an interrupted append
        if zlib.crc32(data[start:end]) != crc:
            return Damage(pos, "payload checksum mismatch")
        return kind, start, end
    if magic == MAGIC_V1:
        # Files of the old format keep the old reading: their header has no checksum of its own.
        if rest < HEADER_V1.size:
            return None
        _, kind, length, crc = HEADER_V1.unpack_from(data, pos)
        start, end = pos + HEADER_V1.size, pos + HEADER_V1.size + length
        if length > MAX_RECORD_BYTES or end > size:
            return None
        if zlib.crc32(data[start:end], zlib.crc32(struct.pack("<HI", kind, length))) != crc:
            return None if _zeros_from(data, end) else Damage(pos, "checksum mismatch")
        return kind, start, end
    return Damage(pos, "bad magic")


def _zeros_from(data: bytes, pos: int) -> bool:
    """Whether `data` holds only zero bytes from `pos` on (looked at only where a record does
    not verify, so reading a healthy file stays linear)."""
    return not data[pos:].strip(b"\0")


def parse(data: bytes, path: Path | str = "<memory>") -> ReadResult:
    records: list[tuple[int, int, bytes]] = []
    pos, size = 0, len(data)
    while pos < size:
        found = _check(data, pos)
        if found is None:
            return ReadResult(records, pos, True)
        if isinstance(found, Damage):
            raise CorruptLog(f"{path}: {found.problem} at offset {found.offset} ({size - pos} bytes "
                             "from there to the end); not a torn tail: `kiln buffer check` reports, "
                             "`kiln buffer repair` salvages")
        kind, start, end = found
        records.append((pos, kind, data[start:end]))
        pos = end
    return ReadResult(records, pos, False)


def salvage(data: bytes) -> tuple[list[tuple[int, int, bytes]], list[Damage]]:
    """Every valid record of a damaged file, skipping damaged stretches: after damage, the next
    offset where a record verifies (header checksum included) resumes the reading."""
    records: list[tuple[int, int, bytes]] = []
    damage: list[Damage] = []
    pos, size = 0, len(data)
    while pos < size:
        found = _check(data, pos)
        if found is None:
            break
        if isinstance(found, Damage):
            damage.append(found)
            nxt = pos + 1
            while nxt < size:
                at = data.find(MAGIC.to_bytes(2, "little"), nxt)
                if at < 0:
                    nxt = size
                    break
                probe = _check(data, at)
                if probe is not None and not isinstance(probe, Damage):
                    nxt = at
                    break
                nxt = at + 1
            pos = nxt
            continue
        kind, start, end = found
        records.append((pos, kind, data[start:end]))
        pos = end
    return records, damage


def read_records(path: Path) -> ReadResult:
    return parse(path.read_bytes(), path)


def truncate(path: Path, size: int) -> None:
    """Cut `path` to `size` bytes and make that durable."""
    with open(path, "r+b") as f:
        f.truncate(size)
        f.flush()
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    """Make creations, renames and deletions of files in `path` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def append_durably(f: BinaryIO, data: bytes) -> None:
    """Write `data` at the end of `f` and fsync before returning. On failure the file is cut
    back to its previous size (nothing buffered, nothing half-written is left) and the error
    raised: the append did not happen."""
    f.flush()  # nothing is ever left in the buffer; os.write below bypasses it
    fd = f.fileno()
    start = os.lseek(fd, 0, os.SEEK_END)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    except OSError:
        try:
            os.ftruncate(fd, start)
            os.fsync(fd)
        finally:
            os.lseek(fd, start, os.SEEK_SET)
        raise
