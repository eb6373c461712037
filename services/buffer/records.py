"""Length-prefixed, checksummed records in append-only files, and recovery of a torn tail.

Layout of one record (little-endian):

    magic u16 (0x4B4C) | kind u16 | length u32 | crc32 u32 | payload (length bytes)

The CRC covers kind, length and payload. The magic makes a zero-filled tail (what some
filesystems leave after a crash that extended the file but did not write it) read as invalid
rather than as an empty record.

A crash can only tear the last record of a file, because records are only ever appended and a
file is fsync'd before the next one is written. `read_records` therefore treats an invalid record
that reaches the end of the file (or is followed only by zero bytes) as torn and reports the
offset to truncate at; an invalid record followed by more data is corruption and raises
`CorruptLog`, because dropping it silently could lose acknowledged data.

Not covered here: what the payloads mean (`store.py`), or fsync policy (the caller decides).
"""
from __future__ import annotations

import os
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Iterable

MAGIC = 0x4B4C
HEADER = struct.Struct("<HHII")
MAX_RECORD_BYTES = 1 << 30


class CorruptLog(Exception):
    """A record in the middle of a log file is invalid. Restarting will not help: the file needs
    inspection (the path and offset are in the message)."""


def encode(kind: int, payload: bytes) -> bytes:
    crc = zlib.crc32(payload, zlib.crc32(struct.pack("<HI", kind, len(payload))))
    return HEADER.pack(MAGIC, kind, len(payload), crc) + payload


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


def parse(data: bytes, path: Path | str = "<memory>") -> ReadResult:
    records: list[tuple[int, int, bytes]] = []
    pos, size = 0, len(data)
    while pos < size:
        problem = None
        if size - pos < HEADER.size:
            problem = "short header"
        else:
            magic, kind, length, crc = HEADER.unpack_from(data, pos)
            end = pos + HEADER.size + length
            if magic != MAGIC:
                problem = "bad magic"
            elif length > MAX_RECORD_BYTES or end > size:
                problem = "record runs past end of file"
            else:
                payload = data[pos + HEADER.size:end]
                expect = zlib.crc32(payload, zlib.crc32(struct.pack("<HI", kind, length)))
                if expect != crc:
                    problem = "checksum mismatch"
        if problem is None:
            records.append((pos, kind, payload))
            pos = end
            continue
        # Invalid record at `pos`. Torn if nothing meaningful follows it.
        if problem in ("short header", "record runs past end of file"):
            return ReadResult(records, pos, True)
        rest = data[end:] if problem == "checksum mismatch" else data[pos:]
        if not rest.strip(b"\0"):
            return ReadResult(records, pos, True)
        raise CorruptLog(f"{path}: {problem} at offset {pos} with {size - pos} bytes after it; "
                         "the file is damaged in the middle, not torn at the end")
    return ReadResult(records, pos, False)


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
    """Write `data` at the end of `f`, then flush and fsync before returning."""
    f.write(data)
    f.flush()
    os.fsync(f.fileno())
