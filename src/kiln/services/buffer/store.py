"""The buffer's durable state: append-only segment files of trajectories and a side log of events.

Directory layout:

    segments/seg-0000000001.log   BufferRecord protos (one per accepted trajectory), in order
    side.log                      JSON events: leased and acked batches, drops, trainer version,
                                  config

Durability: `append` writes a whole Put's records and fsyncs once before returning, so a caller
acknowledges only what is on disk; `log_event` does the same for one event. A new segment file,
a deleted one and a rewritten side log are made durable with an fsync of the directory.

Consumption: an event may carry `"consumed": [ids]` (an acked batch, a drop). Those ids are never
handed back by `open` again; every other stored record is, including those of batches leased
but not acked, so a restart serves those again (see buffer.py). A segment
whose records are all consumed is deleted (compaction); the side log is rewritten as one snapshot
event when it grows past `side_log_bytes`. Consumed ids are kept (in the snapshot) for as long as
the store lives, so a late duplicate Put of a trained-on trajectory is still recognised; they cost
about 50 bytes each.

Recovery: `open` replays the side log, then the segments; a torn last record (a crash during a
write that was therefore never acknowledged) is truncated away; damage anywhere else raises
`CorruptLog` (see records.py).

Not covered here: what the events mean, groups and freshness (`buffer.py`). One process owns a
store directory at a time (the Kubernetes Deployment has one replica, and an flock guards it).
"""
from __future__ import annotations

import fcntl
import json
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kiln.protos.kiln.v1 import buffer_pb2
from kiln.services.buffer import records

log = logging.getLogger("kiln.buffer.store")

KIND_TRAJECTORY = 1
KIND_EVENT = 2
_SEGMENT_RE = re.compile(r"^seg-(\d{10})\.log$")


class StoreLocked(Exception):
    """Another process holds this store directory. Retrying helps once that process exits."""


@dataclass
class Recovered:
    """What `open` found on disk."""

    records: list[buffer_pb2.BufferRecord] = field(default_factory=list)
    """Unconsumed trajectory records (id, serialized trajectory, group size), in append
    order."""
    consumed: set[str] = field(default_factory=set)
    """Ids of every consumed trajectory (in an acked batch, or dropped)."""
    events: list[dict[str, Any]] = field(default_factory=list)
    """Every side-log event, in order (a snapshot event first if the log was compacted)."""
    truncated_bytes: int = 0
    """Bytes of torn records cut off the segment and side log tails."""


@dataclass
class _Segment:
    number: int
    path: Path
    live: set[str] = field(default_factory=set)
    """Ids of unconsumed records in this segment."""


class TrajectoryStore:
    def __init__(self, directory: Path, *, segment_bytes: int = 64 << 20,
                 side_log_bytes: int = 8 << 20) -> None:
        """Use `TrajectoryStore.open`; this constructor touches nothing on disk."""
        self.directory = Path(directory)
        self.segment_dir = self.directory / "segments"
        self.side_path = self.directory / "side.log"
        self.segment_bytes = segment_bytes
        self.side_log_bytes = side_log_bytes
        self._segments: dict[int, _Segment] = {}
        self._where: dict[str, int] = {}  # unconsumed id -> segment number
        self._consumed: set[str] = set()
        self._active: Any = None  # open file of the last segment
        self._active_no = 0
        self._side: Any = None
        self._lock_fd: int | None = None

    # ----------------------------------------------------------------------------- opening

    @classmethod
    def open(cls, directory: Path, **kwargs: Any) -> tuple[TrajectoryStore, Recovered]:
        store = cls(directory, **kwargs)
        try:
            recovered = store._open()
        except BaseException:
            # A refused log (CorruptLog) must not keep the directory locked: whoever repairs it,
            # or opens it again, in this process or another, would be told it is in use.
            store.close()
            raise
        return store, recovered

    def _open(self) -> Recovered:
        self.segment_dir.mkdir(parents=True, exist_ok=True)
        self._lock_fd = os.open(self.directory / "lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            self._lock_fd = None
            raise StoreLocked(f"{self.directory} is in use by another buffer process") from None
        rec = Recovered()
        # A crash during a side-log rewrite leaves side.log.tmp beside an intact side.log.
        self.side_path.with_suffix(".tmp").unlink(missing_ok=True)
        if self.side_path.exists():
            rec.truncated_bytes += self._replay_side_log(rec)
        self._consumed = rec.consumed
        numbers = sorted(int(m.group(1)) for p in self.segment_dir.iterdir()
                         if (m := _SEGMENT_RE.match(p.name)))
        for i, number in enumerate(numbers):
            path = self._segment_path(number)
            result = records.read_records(path)
            if result.torn:
                if i != len(numbers) - 1:
                    raise records.CorruptLog(
                        f"{path}: torn record at offset {result.valid_end} in a segment that is "
                        "not the last; segments are fsync'd before the next one is created")
                rec.truncated_bytes += path.stat().st_size - result.valid_end
                log.warning("truncating torn record at %s offset %d", path, result.valid_end)
                records.truncate(path, result.valid_end)
            seg = _Segment(number, path)
            for _, kind, payload in result.records:
                if kind != KIND_TRAJECTORY:
                    raise records.CorruptLog(f"{path}: unexpected record kind {kind}")
                msg = buffer_pb2.BufferRecord.FromString(payload)
                tid = msg.id
                if tid in self._consumed or tid in self._where:
                    # Consumed, or a copy left by a crash between a write and its acknowledgement
                    # that a retried Put then stored again: the first copy counts.
                    continue
                seg.live.add(tid)
                self._where[tid] = number
                rec.records.append(msg)
            self._segments[number] = seg
        self._open_active(numbers[-1] if numbers else 1)
        self._side = open(self.side_path, "ab")
        records.fsync_dir(self.directory)
        self._compact_segments()
        return rec

    def _replay_side_log(self, rec: Recovered) -> int:
        result = records.read_records(self.side_path)
        for offset, kind, payload in result.records:
            if kind != KIND_EVENT:
                raise records.CorruptLog(f"{self.side_path}: unexpected record kind {kind} at {offset}")
            event = json.loads(payload)
            rec.consumed.update(event.get("consumed", ()))
            rec.events.append(event)
        if result.torn:
            torn = self.side_path.stat().st_size - result.valid_end
            log.warning("truncating torn event at %s offset %d", self.side_path, result.valid_end)
            records.truncate(self.side_path, result.valid_end)
            return torn
        return 0

    def _segment_path(self, number: int) -> Path:
        return self.segment_dir / f"seg-{number:010d}.log"

    def _open_active(self, number: int) -> None:
        if self._active is not None:
            self._active.close()
        path = self._segment_path(number)
        created = not path.exists()
        self._active = open(path, "ab")
        self._active_no = number
        self._segments.setdefault(number, _Segment(number, path))
        if created:
            records.fsync_dir(self.segment_dir)

    # ------------------------------------------------------------------------------ writing

    def append(self, recs: list[tuple[str, bytes, int]]) -> None:
        """Store `recs`, (id, serialized trajectory, group size) each, durably (one fsync).
        Ids must be new: the caller deduplicates. The trajectory bytes are stored as given."""
        if not recs:
            return
        if self._active.tell() >= self.segment_bytes:
            self._open_active(self._active_no + 1)
        data = records.encode_many(
            (KIND_TRAJECTORY, buffer_pb2.BufferRecord(id=tid, trajectory=payload,
                                                      group_size=size).SerializeToString())
            for tid, payload, size in recs)
        # On failure nothing of the batch stays behind for a later append to land after.
        records.append_durably(self._active, data)
        seg = self._segments[self._active_no]
        for tid, _, _ in recs:
            seg.live.add(tid)
            self._where[tid] = self._active_no

    def log_event(self, event: dict[str, Any]) -> None:
        """Append one event durably; ids in `event["consumed"]` are never recovered again."""
        data = records.encode(KIND_EVENT, json.dumps(event, separators=(",", ":")).encode())
        records.append_durably(self._side, data)
        ids = event.get("consumed", ())
        self._consumed.update(ids)
        touched = set()
        for tid in ids:
            number = self._where.pop(tid, None)
            if number is not None:
                self._segments[number].live.discard(tid)
                touched.add(number)
        if touched:
            self._compact_segments()

    @property
    def side_log_size(self) -> int:
        return self._side.tell()

    def needs_snapshot(self) -> bool:
        return self.side_log_size > self.side_log_bytes

    def snapshot(self, state: dict[str, Any]) -> None:
        """Replace the side log with one event: `state` plus every consumed id."""
        event = dict(state, t="snapshot", consumed=sorted(self._consumed))
        tmp = self.side_path.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            records.append_durably(f, records.encode(KIND_EVENT, json.dumps(event).encode()))
        self._side.close()
        tmp.replace(self.side_path)
        records.fsync_dir(self.directory)
        self._side = open(self.side_path, "ab")

    def _compact_segments(self) -> None:
        """Delete every fully consumed segment. The active one is first rolled over, once it is
        big enough that doing so does not churn through tiny files."""
        active = self._segments[self._active_no]
        if not active.live and self._active.tell() >= min(self.segment_bytes, 1 << 20):
            self._open_active(self._active_no + 1)
        removed = False
        for number in sorted(self._segments):
            seg = self._segments[number]
            if number != self._active_no and not seg.live:
                seg.path.unlink(missing_ok=True)
                del self._segments[number]
                removed = True
        if removed:
            records.fsync_dir(self.segment_dir)

    # ------------------------------------------------------------------------------ queries

    def segment_files(self) -> list[Path]:
        return sorted(p for p in self.segment_dir.iterdir() if _SEGMENT_RE.match(p.name))

    def close(self) -> None:
        for f in (self._active, self._side):
            if f is not None:
                f.close()
        self._active = self._side = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
