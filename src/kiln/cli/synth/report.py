"""A synthesis run's report: how many items reached each step, and why every rejected one was
dropped. Written as `report.json` (counts and rejections), `rejections.jsonl` (one line per
rejected item, appended as they happen so a killed run keeps them) and `funnel.png`.

Progress: `progress(step, done, total)` draws a bar on a terminal and a line every 10 s
otherwise, the same habit as `kiln run`'s display.
"""
from __future__ import annotations

import json
import sys
import time
from collections import Counter
from pathlib import Path


class Report:
    def __init__(self, out_dir: Path, pipeline: str, steps: list[str]):
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.pipeline = pipeline
        self.steps = list(steps)
        """The funnel's steps in order; an item counted at a step reached it."""
        self.counts: Counter[str] = Counter()
        self.rejections: list[dict] = []
        self.started = time.monotonic()
        self.extra: dict = {}
        self._last_line = 0.0

    def count(self, step: str, n: int = 1) -> None:
        if step not in self.steps:
            raise ValueError(f"report: unknown step {step!r} ({', '.join(self.steps)})")
        self.counts[step] += n

    def reject(self, item: str, step: str, reason: str) -> None:
        """`item` failed to pass `step` (the step it was trying to reach) because of `reason`."""
        record = {"item": item, "step": step, "reason": reason}
        self.rejections.append(record)
        with (self.out_dir / "rejections.jsonl").open("a") as f:
            f.write(json.dumps(record) + "\n")

    def progress(self, step: str, done: int, total: int) -> None:
        now = time.monotonic()
        tty = sys.stderr.isatty()
        if not tty and done < total and now - self._last_line < 10:
            return
        self._last_line = now
        width = 30
        filled = width * done // max(total, 1)
        line = (f"[{self.pipeline}] {step:<14} [{'#' * filled}{'.' * (width - filled)}] "
                f"{done}/{total}  {now - self.started:6.0f} s")
        sys.stderr.write(("\r" + line + ("\n" if done >= total else "")) if tty else line + "\n")
        sys.stderr.flush()

    def summary(self) -> dict:
        reasons = Counter(f"{r['step']}: {r['reason'].split(':')[0]}" for r in self.rejections)
        return {"pipeline": self.pipeline, "wall_seconds": round(time.monotonic() - self.started, 1),
                "funnel": {s: self.counts[s] for s in self.steps},
                "rejected_by_reason": dict(reasons.most_common()), **self.extra}

    def write(self) -> dict:
        summary = self.summary()
        (self.out_dir / "report.json").write_text(json.dumps(summary, indent=2) + "\n")
        try:
            self._plot(summary)
        except ImportError:  # matplotlib is optional for the pipelines themselves
            pass
        return summary

    def _plot(self, summary: dict) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        steps = list(summary["funnel"])
        counts = [summary["funnel"][s] for s in steps]
        fig, ax = plt.subplots(figsize=(7, 0.5 * len(steps) + 1.5))
        ax.barh(range(len(steps)), counts, color="#c0504d")
        ax.set_yticks(range(len(steps)), steps)
        ax.invert_yaxis()
        for i, c in enumerate(counts):
            ax.text(c, i, f" {c}", va="center")
        ax.set_xlabel("items")
        ax.set_title(f"kiln synth {self.pipeline}: funnel")
        fig.tight_layout()
        fig.savefig(self.out_dir / "funnel.png", dpi=100)
        plt.close(fig)
