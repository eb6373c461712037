"""What a synthesis run has decided, kept in `OUT/state.jsonl` so a re-run skips it.

One line per item, appended the moment its verdict is known: `{"item", "verdict": "kept" |
"rejected", "reached": [steps], "step", "reason"}`. A killed run loses only the items in flight;
a re-run replays the decided ones into the report (their funnel steps and rejection reasons) so
the report of a resumed run reads as one run's.
"""
from __future__ import annotations

import json
from pathlib import Path

from .report import Report


class Ledger:
    def __init__(self, out_dir: Path, report: Report):
        self.path = Path(out_dir) / "state.jsonl"
        self.report = report
        self.decided: dict[str, dict] = {}
        if self.path.is_file():
            for n, line in enumerate(self.path.read_text().splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                    self.decided[rec["item"]] = rec
                except (json.JSONDecodeError, KeyError, TypeError):
                    # A line cut by a kill mid-write: that item is simply done again.
                    continue

    def __contains__(self, item: str) -> bool:
        return item in self.decided

    def replay(self, item: str) -> dict:
        """Count an item an earlier run decided as that run did; returns its record."""
        rec = self.decided[item]
        for step in rec.get("reached", []):
            self.report.count(step)
        if rec["verdict"] == "rejected":
            self.report.rejections.append({"item": item, "step": rec["step"],
                                           "reason": rec["reason"]})
        return rec

    def kept(self, item: str, reached: list[str], **extra) -> None:
        self._write({"item": item, "verdict": "kept", "reached": list(reached), **extra})

    def rejected(self, item: str, step: str, reason: str, reached: list[str]) -> None:
        self.report.reject(item, step, reason)
        self._write({"item": item, "verdict": "rejected", "step": step, "reason": reason,
                     "reached": list(reached)})

    def _write(self, record: dict) -> None:
        self.decided[record["item"]] = record
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
