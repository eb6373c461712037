"""One `kiln run` of the async RL benchmark (`bench.py`), watched while it runs: its services'
ports from the run directory, the trainer's idle counter, the rollout engine's idle counter and
the buffer's staleness histogram scraped from their /metrics endpoints, the CPU time of the
trainer's and rollout's process trees from /proc, and the load average, every half second, into
a `RunTrace` that `bench.measure` turns into the figures; and the SFT run's last checkpoint
exported as the HF model both RL jobs start from.

Imported by `bench.py` as a sibling module (run as a script, its folder is `sys.path[0]`).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import yaml

IDLE_METRIC = "kiln_trainer_idle_seconds_total"
ENGINE_IDLE_METRIC = "kiln_rollout_engine_idle_seconds_total"
STALENESS_METRIC = "kiln_trajectory_staleness_bucket"


@dataclass
class RunTrace:
    """What was sampled while one `kiln run` ran."""

    run_dir: Path
    seconds: float = 0.0
    idle: list[tuple[float, float]] = field(default_factory=list)
    """(time, kiln_trainer_idle_seconds_total) scrapes."""
    engine_idle: list[tuple[float, float]] = field(default_factory=list)
    """(time, kiln_rollout_engine_idle_seconds_total) scrapes."""
    staleness: dict[str, float] = field(default_factory=dict)
    """The buffer's last kiln_trajectory_staleness buckets (upper bound -> cumulative count)."""
    cpu: list[tuple[float, dict[str, float]]] = field(default_factory=list)
    """(time, CPU seconds per service process tree)."""
    load: list[tuple[float, float]] = field(default_factory=list)
    """(time, 1-minute load average)."""


def _ports(run_dir: Path, service: str) -> dict | None:
    try:
        return json.loads((run_dir / service / "ports.json").read_text())
    except (OSError, ValueError):
        return None


def _scrape(port: int) -> str | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as resp:
            return resp.read().decode()
    except OSError:
        return None  # not serving yet, or already stopped


def _sample(text: str | None, metric: str, who: str) -> float | None:
    if text is None:
        return None
    for line in text.splitlines():
        if line.startswith(metric + " "):
            return float(line.split()[1])
    raise RuntimeError(f"the {who}'s /metrics has no {metric}")


def _buckets(text: str | None) -> dict[str, float]:
    out = {}
    for line in (text or "").splitlines():
        if line.startswith(STALENESS_METRIC + "{"):
            le = line[line.index('le="') + 4:line.index('"}')]
            out[le] = float(line.split()[-1])
    return out


_TICK = os.sysconf("SC_CLK_TCK")


def _process_table() -> dict[int, tuple[int, float]]:
    """pid -> (parent pid, CPU seconds used so far)."""
    table = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "
        table[int(entry.name)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / _TICK)
    return table


def _tree_cpu(table: dict[int, tuple[int, float]], root: int) -> float:
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    total, todo = 0.0, [root]
    while todo:
        pid = todo.pop()
        if pid in table:
            total += table[pid][1]
        todo += children.get(pid, [])
    return total


def run_kiln(job: dict, work_dir: Path, timeout: float, out) -> RunTrace:
    name = job["metadata"]["name"]
    job_file = work_dir / f"{name}.yaml"
    job_file.write_text(yaml.safe_dump(job, sort_keys=False))
    run_dir = work_dir / name
    log_path = work_dir / f"{name}.log"
    trace = RunTrace(run_dir)
    out.write(f"[{name}] kiln run {job_file.name} (log: {log_path})\n")
    out.flush()
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kiln.cli.main", "run", str(job_file), "--run-dir", str(run_dir)],
            stdout=log, stderr=subprocess.STDOUT, cwd=work_dir)
        try:
            while proc.poll() is None:
                now = time.time()
                trace.load.append((now, os.getloadavg()[0]))
                trainer = _ports(run_dir, "trainer")
                if trainer:
                    value = _sample(_scrape(trainer["metrics_port"]), IDLE_METRIC, "trainer")
                    if value is not None:
                        trace.idle.append((now, value))
                rollout = _ports(run_dir, "rollout")
                if rollout:
                    value = _sample(_scrape(rollout["metrics_port"]), ENGINE_IDLE_METRIC, "rollout")
                    if value is not None:
                        trace.engine_idle.append((now, value))
                buffer = _ports(run_dir, "buffer")
                if buffer:
                    trace.staleness = _buckets(_scrape(buffer["metrics_port"])) or trace.staleness
                pids = {s: p["pid"] for s in ("trainer", "rollout") if (p := _ports(run_dir, s))}
                if pids:
                    table = _process_table()
                    trace.cpu.append((now, {s: _tree_cpu(table, pid) for s, pid in pids.items()}))
                if time.monotonic() - t0 > timeout:
                    raise TimeoutError(f"{name} ran past {timeout:.0f} s")
                time.sleep(0.5)
        except BaseException:
            # The launcher stops its services in order on SIGTERM; never leave them behind.
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(90)
            except subprocess.TimeoutExpired:
                proc.kill()
            raise
    trace.seconds = time.monotonic() - t0
    if proc.returncode != 0:
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-20:])
        raise RuntimeError(f"{name}: kiln run exited with {proc.returncode}; log tail:\n{tail}")
    out.write(f"[{name}] done in {trace.seconds:.0f} s\n")
    out.flush()
    return trace


def export_model(init_dir: Path, sft_run: Path, out_dir: Path) -> None:
    """The SFT run's last trainer checkpoint as a HF directory (config and tokenizer from init)."""
    from kiln.models.hf_io import write_hf_dir
    from kiln.services.trainer.config import TrainerConfig
    from kiln.services.trainer.engine import TrainerEngine

    ckpts = sft_run / "trainer" / "checkpoints"
    engine = TrainerEngine(TrainerConfig(model_dir=init_dir, checkpoint_dir=ckpts))
    if engine.resumed_from is None:
        raise RuntimeError(f"{ckpts}: the SFT run left no checkpoint")
    write_hf_dir(engine.named_hf_tensors(), out_dir, source_dir=init_dir)
