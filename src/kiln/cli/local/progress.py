"""What `kiln run` shows and records of a running job: the stage driver's (`kiln.control.driver`)
messages and progress as a live line on a terminal (a line every 10 s in a log), and every
progress record and event appended to RUN_DIR/metrics.jsonl (what the report plots)."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from kiln.control.driver import Progress


class LocalProgress:
    def __init__(self, run_dir: Path, out=sys.stdout) -> None:
        self.metrics_file = Path(run_dir) / "metrics.jsonl"
        self.out = out
        self._last_step: int | None = None
        self._last_print = 0.0
        self._open_line = False

    def say(self, text: str) -> None:
        if self._open_line:
            self.out.write("\n")
            self._open_line = False
        self.out.write(text + "\n")
        self.out.flush()

    def event(self, record: dict[str, Any]) -> None:
        with open(self.metrics_file, "a") as f:
            f.write(json.dumps(record, default=str) + "\n")

    def progress(self, p: Progress) -> None:
        self.event(p.record())
        step, stage = p.step, p.stage
        t, r, b = p.trainer, p.rollout, p.buffer
        eta = p.elapsed / step * (stage.max_steps - step) if step else float("nan")
        m = t.last_step if t.stage == stage.name else None
        parts = [f"[{stage.name}] step {step}/{stage.max_steps}", f"v{t.policy_version}"]
        if m is not None:
            parts.append(f"loss {m.loss:.4f}")
            if m.reward_mean is not None:  # RL steps only: the batch's reward, its staleness
                parts += [f"reward {m.reward_mean:.3f}", f"rollout pass {r.mean_reward:.3f}",
                          f"staleness<={max(0, b.max_staleness)}", f"dropped {b.dropped_stale}"]
        parts += [f"{r.tokens_per_second:.0f} tok/s", f"ETA {eta:.0f}s"]
        line = "\r" + "  ".join(parts) + "   "
        if self.out.isatty():
            self.out.write(line)
            self.out.flush()
            self._open_line = True
        elif step and step != self._last_step and (
                step == stage.max_steps or time.monotonic() - self._last_print >= 10):
            # Logs (CI, `| tee`) get a line every 10 s rather than a redrawn one.
            self.out.write(line.lstrip("\r").rstrip() + "\n")
            self.out.flush()
            self._last_step, self._last_print = step, time.monotonic()
