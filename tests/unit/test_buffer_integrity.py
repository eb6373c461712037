"""No silent loss in the buffer's files: every bit of a stored record flipped in turn either
leaves every acknowledged trajectory recoverable or stops the buffer with the file and offset
named, never truncates quietly; `kiln buffer check` and `repair` on real directories."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kiln.services.buffer import records
from kiln.services.buffer.store import TrajectoryStore
from kiln.services.buffer.synthetic import synthetic_trajectory
from kiln.services.common import codec

IDS = ["a", "b", "c", "d", "e"]


def _store(tmp: Path) -> Path:
    d = tmp / "buffer"
    store, _ = TrajectoryStore.open(d)
    for batch in (IDS[:2], IDS[2:4], IDS[4:]):  # three acknowledged Puts
        store.append([(t, codec.to_bytes(synthetic_trajectory(t, tokens=6)), 1) for t in batch])
    store.log_event({"event": "trainer_version", "version": 3})
    store.close()
    return d


def _segment(d: Path) -> Path:
    (seg,) = sorted((d / "segments").glob("seg-*.log"))
    return seg


def _flip_all(d: Path, path: Path, start: int, end: int, tmp: Path) -> tuple[int, int]:
    """Flip each bit of path[start:end] on a copy of `d` and open the store; returns
    (recovered everything, refused with the offset named)."""
    recovered = refused = 0
    original = path.read_bytes()
    for byte in range(start, end):
        for bit in range(8):
            work = tmp / "work"
            shutil.rmtree(work, ignore_errors=True)
            shutil.copytree(d, work)
            damaged = bytearray(original)
            damaged[byte] ^= 1 << bit
            target = work / path.relative_to(d)
            target.write_bytes(bytes(damaged))
            try:
                store, rec = TrajectoryStore.open(work)
            except records.CorruptLog as exc:
                assert str(target) in str(exc) and "at offset" in str(exc), exc
                refused += 1
                continue
            ids = [r.id for r in rec.records]
            store.close()
            # Nothing acknowledged lost: a flip the checksums cannot see would have to be in
            # bytes no record uses.
            assert ids == IDS, (byte, bit, ids)
            recovered += 1
    return recovered, refused


def test_every_bit_of_the_last_and_a_middle_record(tmp_path: Path) -> None:
    d = _store(tmp_path)
    seg = _segment(d)
    found = records.read_records(seg).records
    last_start = found[-1][0]
    middle_start, middle_end = found[2][0], found[3][0]
    for start, end in ((last_start, seg.stat().st_size), (middle_start, middle_end)):
        recovered, refused = _flip_all(d, seg, start, end, tmp_path)
        # Every flip lands in a header or a checksummed payload: each is caught.
        assert refused == (end - start) * 8 and recovered == 0
    side = d / "side.log"
    recovered, refused = _flip_all(d, side, 0, side.stat().st_size, tmp_path)
    assert refused == side.stat().st_size * 8


def _kiln(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kiln.cli", "buffer", *args], capture_output=True,
                          text=True, timeout=60)


def test_check_and_repair(tmp_path: Path) -> None:
    d = _store(tmp_path)
    ok = _kiln("check", str(d))
    assert ok.returncode == 0 and "OK" in ok.stdout, ok.stderr
    seg = _segment(d)
    found = records.read_records(seg).records
    data = bytearray(seg.read_bytes())
    data[found[1][0] + 20] ^= 0x10  # inside record "b"'s payload
    seg.write_bytes(bytes(data))
    bad = _kiln("check", str(d))
    assert bad.returncode == 3
    assert f"{seg}: DAMAGED: payload checksum mismatch at offset {found[1][0]}" in bad.stderr
    plan = _kiln("repair", str(d))
    assert plan.returncode == 3 and "keeps 4 records" in plan.stdout and "--yes" in plan.stderr
    assert _kiln("check", str(d)).returncode == 3  # nothing written without --yes
    done = _kiln("repair", str(d), "--yes")
    assert done.returncode == 0, done.stderr
    assert (seg.parent / (seg.name + ".damaged")).exists()
    assert _kiln("check", str(d)).returncode == 0
    store, rec = TrajectoryStore.open(d)
    assert [r.id for r in rec.records] == ["a", "c", "d", "e"]  # only the damaged record lost
    store.close()


def test_check_refuses_a_folder_that_is_no_buffer(tmp_path: Path) -> None:
    res = _kiln("check", str(tmp_path))
    assert res.returncode == 1 and "not a buffer directory" in res.stderr


def test_a_torn_tail_is_healthy(tmp_path: Path) -> None:
    d = _store(tmp_path)
    seg = _segment(d)
    with open(seg, "ab") as f:
        f.write(records.encode(1, b"x" * 100)[:40])  # an append cut short
    res = _kiln("check", str(d))
    assert res.returncode == 0 and "torn tail" in res.stdout


@pytest.fixture(autouse=True)
def _no_leftovers(tmp_path: Path):
    yield
    shutil.rmtree(tmp_path / "work", ignore_errors=True)
