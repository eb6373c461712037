"""Rate-limited logging of refused requests: a client looping on a bad call (or an attacker
probing) must not turn each refusal into a log line, filling the disk and hiding everything
else. The counters (`kiln_rpc_requests_total{code=...}`) still count every call.

    refusals = LogLimiter(burst=5, period_s=60)
    refusals.log(log, logging.WARNING, ("Publish", "stale"), "publish rejected: %s", exc)

Per key, at most `burst` lines per `period_s`; the first line of the next period says how many
were left out. Thread-safe (handlers of the sync servers run in threads).
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Hashable

#: Keys remembered at most; past it the oldest windows are forgotten (a flood of distinct keys
#: must not grow the limiter itself without bound).
MAX_KEYS = 1024


class LogLimiter:
    def __init__(self, burst: int = 5, period_s: float = 60.0,
                 clock=time.monotonic) -> None:
        self.burst, self.period_s, self._clock = burst, period_s, clock
        self._windows: dict[Hashable, list[float | int]] = {}  # key -> [start, logged, dropped]
        self._lock = threading.Lock()

    def admit(self, key: Hashable) -> tuple[bool, int]:
        """(whether to log this one, how many of `key` were suppressed before it)."""
        now = self._clock()
        with self._lock:
            window = self._windows.get(key)
            if window is None or now - window[0] >= self.period_s:
                dropped = int(window[2]) if window is not None else 0
                if window is None and len(self._windows) >= MAX_KEYS:
                    self._windows.pop(next(iter(self._windows)))
                self._windows[key] = [now, 1, 0]
                return True, dropped
            if window[1] < self.burst:
                window[1] += 1
                return True, 0
            window[2] += 1
            return False, 0

    def log(self, logger: logging.Logger, level: int, key: Hashable, msg: str, *args: Any,
            **kwargs: Any) -> None:
        ok, dropped = self.admit(key)
        if not ok:
            return
        if dropped:
            msg = f"{msg} ({dropped} more like it in the last {self.period_s:g} s not logged)"
        logger.log(level, msg, *args, **kwargs)
