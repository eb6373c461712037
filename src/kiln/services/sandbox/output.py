"""Bounded capture of a command's output.

A sandboxed command may print gigabytes; `CappedBuffer` keeps the first `limit` bytes, counts
the rest while dropping it, and renders a visible marker so neither a model nor a human mistakes
a cut log for a complete one. Memory per stream is bounded by `limit` plus one read chunk.

Not covered: where the bytes come from (pipes for bubblewrap, the engine's stream for docker).
"""
from __future__ import annotations

import asyncio

READ_CHUNK = 64 << 10


def truncation_marker(dropped: int) -> str:
    return f"\n[kiln-sandbox: output truncated, {dropped} more bytes dropped]\n"


class CappedBuffer:
    """Keeps at most `limit` bytes; everything after is counted and discarded."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._parts: list[bytes] = []
        self._kept = 0
        self.dropped = 0

    def feed(self, data: bytes) -> None:
        room = self.limit - self._kept
        if room > 0:
            piece = data[:room]
            self._parts.append(piece)
            self._kept += len(piece)
            self.dropped += len(data) - len(piece)
        else:
            self.dropped += len(data)

    @property
    def truncated(self) -> bool:
        return self.dropped > 0

    def text(self) -> str:
        body = b"".join(self._parts).decode("utf-8", errors="replace")
        if self.dropped:
            body += truncation_marker(self.dropped)
        return body


async def drain(stream: asyncio.StreamReader | None, buf: CappedBuffer) -> None:
    """Read `stream` to EOF into `buf` (reading on past the cap keeps the writer unblocked)."""
    if stream is None:
        return
    while True:
        chunk = await stream.read(READ_CHUNK)
        if not chunk:
            return
        buf.feed(chunk)
