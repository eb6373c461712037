"""What `kiln run` shows and records of a running job: the stage driver's (`kiln.control.driver`)
messages and progress as a live line on a terminal (a line every 10 s in a log), and every
progress record and event appended to RUN_DIR/metrics.jsonl (what the report plots).

The line has the columns of the stage's type (`columns`): an SFT stage has no reward, rollout
pass rate or staleness worth showing, an RL stage has all of them. The ETA is the whole job's:
its training steps (this stage's and the later stages') at the pace of the last steps, plus its
held-out evaluations still to come, each at the time that task set's evaluations have taken so
far (the mean of all evaluations for a task set not evaluated yet; none before the first ends).
When the run ends or stops, `stage_table` sums each stage up."""
from __future__ import annotations

import json
import shutil
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any

from kiln.api.spec import RLJob, SFTStage
from kiln.control.driver import Progress
from kiln.control.progress import evaluations_left, steps_left


class LocalProgress:
    """`job` (when given) is what the whole-job ETA counts: the steps left in the running stage
    and in every stage after it, at the recent time per step."""

    def __init__(self, run_dir: Path, out=sys.stdout, job: RLJob | None = None) -> None:
        self.metrics_file = Path(run_dir) / "metrics.jsonl"
        self.out = out
        self.job = job
        self._last_step: int | None = None
        self._last_print = 0.0
        self._open_line = False
        # (monotonic time, global step) whenever the global step changed: the recent pace.
        self._pace: deque[tuple[float, int]] = deque(maxlen=PACE_STEPS + 1)
        # Seconds each finished held-out evaluation took, by task set.
        self._eval_seconds: dict[str, list[float]] = {}

    def say(self, text: str) -> None:
        if self._open_line:
            self.out.write("\n")
            self._open_line = False
        self.out.write(text + "\n")
        self.out.flush()

    def event(self, record: dict[str, Any]) -> None:
        if record.get("event") == "eval" and record.get("seconds") is not None:
            self._eval_seconds.setdefault(record["task_set"], []).append(float(record["seconds"]))
        with open(self.metrics_file, "a") as f:
            f.write(json.dumps(record, default=str) + "\n")

    def progress(self, p: Progress) -> None:
        self.event(p.record())
        step, stage = p.step, p.stage
        if not self._pace or self._pace[-1][1] != p.trainer.step:
            self._pace.append((time.monotonic(), p.trainer.step))
        # The ETA before the columns: what a narrow terminal cuts off is the end of the line.
        parts = [f"[{stage.name}] step {step}/{stage.max_steps}", f"v{p.trainer.policy_version}",
                 f"ETA {fmt_seconds(self.eta(p))}", *columns(p)]
        line = "\r" + "  ".join(parts) + "   "
        if self.out.isatty():
            # Redrawn in place: a line wider than the terminal would wrap and not be redrawn.
            width = shutil.get_terminal_size().columns
            self.out.write(line[:width] if len(line) > width else line)
            self.out.flush()
            self._open_line = True
        elif step and step != self._last_step and (
                step == stage.max_steps or time.monotonic() - self._last_print >= 10):
            # Logs (CI, `| tee`) get a line every 10 s rather than a redrawn one.
            self.out.write(line.lstrip("\r").rstrip() + "\n")
            self.out.flush()
            self._last_step, self._last_print = step, time.monotonic()

    def eta(self, p: Progress) -> float | None:
        """Seconds until the job's end: the steps left in this stage and every later one, at the
        mean time of the last `PACE_STEPS` steps, and the evaluations still to come (module
        docstring). None before two steps were seen."""
        if len(self._pace) < 2 or self._pace[-1][1] == self._pace[0][1]:
            return None
        (t0, s0), (t1, s1) = self._pace[0], self._pace[-1]
        left = (steps_left(self.job, p.stage.name, p.step) if self.job is not None
                else max(0, p.stage.max_steps - p.step))
        return left * (t1 - t0) / (s1 - s0) + self._evaluations_eta(p)

    def _evaluations_eta(self, p: Progress) -> float:
        if self.job is None or not self._eval_seconds:
            return 0.0
        every = [t for times in self._eval_seconds.values() for t in times]
        overall = sum(every) / len(every)
        total = 0.0
        for task_set in evaluations_left(self.job, p.stage.name, p.step):
            times = self._eval_seconds.get(task_set)
            total += sum(times) / len(times) if times else overall
        return total


#: How many recent steps the ETA's pace is measured over.
PACE_STEPS = 10


def columns(p: Progress) -> list[str]:
    """The figures that mean something for the stage's type: an SFT step's loss, learning rate
    and training tokens/s; an RL step's loss, batch reward, rollout pass rate, staleness,
    masked token fractions and rollout's tokens/s. Nothing of a step before the stage's first."""
    t, r, b = p.trainer, p.rollout, p.buffer
    m = t.last_step if t.stage == p.stage.name and p.step else None
    if isinstance(p.stage, SFTStage):
        if m is None:
            return []
        return [f"loss {m.loss:.4f}", f"lr {m.lr:.2e}", f"{m.tokens_per_second:.0f} train tok/s"]
    out = []
    if m is not None:
        out.append(f"loss {m.loss:.4f}")
        if m.reward_mean is not None:
            out.append(f"reward {m.reward_mean:.3f}")
    out += [f"pass {r.mean_reward:.3f}",
            f"staleness<={max(0, b.max_staleness)} (dropped {b.dropped_stale})"]
    if m is not None and m.ratio_only_frac is not None:
        out.append(f"masked ratio {m.ratio_only_frac:.3f} icepop {m.icepop_only_frac or 0:.3f} "
                   f"both {m.both_masked_frac or 0:.3f}")
    out.append(f"{r.tokens_per_second:.0f} gen tok/s")
    return out


def fmt_seconds(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    seconds = int(round(seconds))
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


def stage_table(job: RLJob, records: list[dict[str, Any]],
                evaluations: dict[str, dict[str, Any]]) -> str:
    """The table printed when a run ends (or stops): per stage its type, steps done of its
    maximum, final loss and batch reward, and the greedy held-out success after it."""
    rows = [("stage", "type", "steps", "loss", "reward", "held-out greedy (after)")]
    for stage in job.spec.stages:
        mine = [r for r in records if r.get("event") == "progress" and r.get("stage") == stage.name
                and (r.get("trainer") or {}).get("stage") == stage.name and r.get("step")]
        last = mine[-1]["trainer"] if mine else {}
        evals = [f"{ts} {evaluations[k]['greedy_success']:.3f}"
                 for ts in (stage.eval.tasks if stage.eval else [])
                 if (k := f"{stage.name}/after/{ts}") in evaluations]
        steps = max((r["step"] for r in mine), default=0)
        rows.append((stage.name, stage.type, f"{steps}/{stage.max_steps}",
                     f"{last['loss']:.4f}" if last.get("loss") is not None else "-",
                     f"{last['reward_mean']:.3f}" if last.get("reward_mean") is not None else "-",
                     ", ".join(evals) or "-"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows)


def run_table(job: RLJob, run_dir: Path) -> str:
    """`stage_table` of the run in `run_dir`, from its metrics.jsonl and state.json."""
    path = Path(run_dir) / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()
               if line.strip()] if path.exists() else []
    state = Path(run_dir) / "state.json"
    evaluations = json.loads(state.read_text()).get("evaluations", {}) if state.exists() else {}
    return stage_table(job, records, evaluations)
