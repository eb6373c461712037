"""`kiln run`'s clock (`kiln.cli.local.deadline`): the deadline passes only when the spec sets one
and its seconds are spent; the TTL is said to be cluster-only; a run that passed its deadline
has `summary.json` say so beside what it did. The whole run stopped by its deadline is
tests/integration/test_kiln_run_deadline.py (slow)."""
from __future__ import annotations

import json
import time
from pathlib import Path

from kiln.cli.local.deadline import DEADLINE_EXCEEDED, Deadline, mark_failed, ttl_note

from helpers.operator_jobs import SMALL, spec


def test_the_deadline_passes_once_its_seconds_are_spent() -> None:
    assert not Deadline(spec(SMALL), time.monotonic() - 1e6).passed()  # none set: never
    timed = spec(SMALL, activeDeadlineSeconds=30)
    assert not Deadline(timed, time.monotonic()).passed()
    assert Deadline(timed, time.monotonic() - 30).passed()
    assert "spec.activeDeadlineSeconds (30s)" in Deadline(timed, 0).message()


def test_the_ttl_is_cluster_only_and_said_so() -> None:
    assert ttl_note(spec(SMALL)) is None
    assert "applies on a cluster only" in ttl_note(spec(SMALL, ttlSecondsAfterFinished=0))


def test_a_failed_run_keeps_its_summary_and_says_why(tmp_path: Path) -> None:
    (tmp_path / "summary.json").write_text(json.dumps({"steps": 7}))
    mark_failed(tmp_path, DEADLINE_EXCEEDED, "past it")
    assert json.loads((tmp_path / "summary.json").read_text()) == {
        "steps": 7, "phase": "Failed", "reason": "DeadlineExceeded", "message": "past it"}
