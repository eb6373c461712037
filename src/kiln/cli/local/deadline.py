"""A job's clock under `kiln run`: `spec.activeDeadlineSeconds` and
`spec.ttlSecondsAfterFinished`, as far as one machine can keep them.

- `activeDeadlineSeconds` counts from this `kiln run`'s start (a `--resume` starts it again, as
  a cluster sets `status.startTime` again on each resume). Past it, the driver stops at its
  next call to a service (`Deadline.passed`, its `should_stop` hook: never half-way through
  recording a stage or an evaluation), the services stop as on Ctrl-C (the trainer writes its
  checkpoint, the buffer keeps every trajectory it accepted on disk), and the run ends Failed:
  `summary.json` says `phase: Failed`, `reason: DeadlineExceeded` and the message, and `kiln
  run` exits FAILED. `kiln run --resume RUN_DIR` continues it, with a fresh deadline.
- `ttlSecondsAfterFinished` deletes a finished RLJob on a cluster; `kiln run` has no object to
  delete and keeps its run directory, which it says once (`ttl_note`).
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from kiln.api.spec import RLJobSpec

DEADLINE_EXCEEDED = "DeadlineExceeded"
"""The reason a run that passed its deadline failed with (as an RLJob's condition says)."""


class Deadline:
    """`spec.activeDeadlineSeconds` from `started` (time.monotonic()); never passes without one."""

    def __init__(self, spec: RLJobSpec, started: float) -> None:
        self.seconds = spec.active_deadline_seconds
        self.at = None if self.seconds is None else started + self.seconds

    def passed(self) -> bool:
        return self.at is not None and time.monotonic() >= self.at

    def message(self) -> str:
        return (f"the run ran past spec.activeDeadlineSeconds ({self.seconds}s); the trainer's "
                "checkpoint and the buffer keep what was done: kiln run --resume continues it")


def ttl_note(spec: RLJobSpec) -> str | None:
    """One line for a job with `ttlSecondsAfterFinished`, which only a cluster applies."""
    if spec.ttl_seconds_after_finished is None:
        return None
    return (f"note: spec.ttlSecondsAfterFinished ({spec.ttl_seconds_after_finished}s) applies on "
            "a cluster only (the finished RLJob is deleted); kiln run keeps its run directory")


def mark_failed(run_dir: Path, reason: str, message: str) -> dict[str, Any]:
    """Add the run's end (phase Failed, the reason and message) to its `summary.json`."""
    path = run_dir / "summary.json"
    summary = json.loads(path.read_text()) if path.exists() else {}
    summary.update(phase="Failed", reason=reason, message=message)
    path.write_text(json.dumps(summary, indent=2))
    return summary
