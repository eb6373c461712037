"""Refused requests are logged a few per minute per kind, with a count of what was left out."""
from __future__ import annotations

import logging

from kiln.services.common import ratelimit
from kiln.services.common.ratelimit import LogLimiter


def test_a_flood_logs_a_burst_then_one_line_with_the_count(caplog) -> None:
    now = [0.0]
    limiter = LogLimiter(burst=3, period_s=60, clock=lambda: now[0])
    log = logging.getLogger("test.ratelimit")
    with caplog.at_level(logging.WARNING, "test.ratelimit"):
        for i in range(1000):
            limiter.log(log, logging.WARNING, ("Publish", "stale"), "rejected %d", i)
        limiter.log(log, logging.WARNING, ("Ack", "r1"), "other kind")  # its own budget
        now[0] = 61.0
        limiter.log(log, logging.WARNING, ("Publish", "stale"), "rejected %d", 1000)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[:3] == ["rejected 0", "rejected 1", "rejected 2"]
    assert lines[3] == "other kind"
    assert lines[4] == "rejected 1000 (997 more like it in the last 60 s not logged)"
    assert len(lines) == 5


def test_distinct_keys_do_not_grow_the_limiter_without_bound() -> None:
    limiter = LogLimiter(burst=1, period_s=60, clock=lambda: 0.0)
    for i in range(ratelimit.MAX_KEYS * 3):
        assert limiter.admit(("Ack", f"replica-{i}")) == (True, 0)
    assert len(limiter._windows) == ratelimit.MAX_KEYS
