"""What crosses the trainer's data-plane wire: a stage export cut into checked pieces
(`export_chunks` on the servicer's side, `ExportWriter` on the client's). Its control messages
(stage orders, status) are the control floor's (`kiln.control.wire`)."""
from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path
from typing import Iterable, Iterator

from kiln.protos.kiln.v1 import trainer_pb2

__all__ = ["export_chunks", "ExportWriter", "ExportError", "CHUNK_BYTES"]

CHUNK_BYTES = 1 << 20  # well under the channels' message limit


class ExportError(ValueError):
    """The pieces received do not make the files they announced (truncated or corrupt); the
    fetch can be retried from the start."""


def export_chunks(folder: Path, chunk_bytes: int = CHUNK_BYTES) -> Iterator[trainer_pb2.ExportChunk]:
    """The files under `folder`, each as pieces in order: size on the first, digest on the last.
    Every file is opened before the first piece goes out: a stage exported again meanwhile (a
    resumed trainer does) replaces the folder, and open files keep the contents they had."""
    paths = sorted(p for p in Path(folder).rglob("*") if p.is_file())
    files = [(p.relative_to(folder).as_posix(), p.open("rb")) for p in paths]
    try:
        for rel, f in files:
            size = os.fstat(f.fileno()).st_size
            digest = hashlib.sha256()
            first = True
            while True:
                data = f.read(chunk_bytes)
                digest.update(data)
                done = f.tell() >= size or not data
                yield trainer_pb2.ExportChunk(path=rel, data=data, size=size if first else 0,
                                              sha256=digest.hexdigest() if done else "")
                first = False
                if done:
                    break
    finally:
        for _, f in files:
            f.close()


class ExportWriter:
    """Writes received pieces under a hidden folder beside `dest` and renames it to `dest` once
    every file checked out, so a folder at `dest` is always a whole export."""

    def __init__(self, dest: Path) -> None:
        self.dest = Path(dest)
        self.tmp = self.dest.with_name(f".{self.dest.name}.partial-{os.getpid()}")
        self.files = 0
        self.bytes = 0

    def write(self, chunks: Iterable[trainer_pb2.ExportChunk]) -> Path:
        if self.tmp.exists():
            shutil.rmtree(self.tmp)
        self.tmp.mkdir(parents=True)
        try:
            self._receive(chunks)
            if self.dest.exists():
                shutil.rmtree(self.dest)
            self.tmp.rename(self.dest)
        finally:
            if self.tmp.exists():
                shutil.rmtree(self.tmp)
        return self.dest

    def _receive(self, chunks: Iterable[trainer_pb2.ExportChunk]) -> None:
        current, out, digest, expected, got = None, None, None, 0, 0
        try:
            for c in chunks:
                if c.path != current:
                    if current is not None:
                        raise ExportError(f"{current}: the next file began before its digest came")
                    rel = Path(c.path)
                    if rel.is_absolute() or ".." in rel.parts or not c.path:
                        raise ExportError(f"refusing a file path outside the export: {c.path!r}")
                    target = self.tmp / rel
                    target.parent.mkdir(parents=True, exist_ok=True)
                    current, out, digest = c.path, target.open("wb"), hashlib.sha256()
                    expected, got = c.size, 0
                out.write(c.data)
                digest.update(c.data)
                got += len(c.data)
                if c.sha256:
                    out.close()
                    if got != expected or digest.hexdigest() != c.sha256:
                        raise ExportError(f"{current}: received {got} of {expected} bytes, "
                                          "or a digest that does not match")
                    self.files += 1
                    self.bytes += got
                    current, out = None, None
            if current is not None:
                raise ExportError(f"{current}: the stream ended inside the file")
            if not (self.tmp / "config.json").exists():
                raise ExportError("the export holds no config.json")
        finally:
            if out is not None:
                out.close()
