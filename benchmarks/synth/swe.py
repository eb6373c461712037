"""`kiln synth swe` throughput: tasks verified per hour per core, with the environment cache on
and, as the baseline in the same run, off (every snapshot probed again).

Runs the real pipeline twice on the same commits, each into a fresh output folder, and prints
the funnel, wall time, environment probes and tasks (and candidates) verified per hour per
core. `--jobs` candidates run at once; "per core" divides by the cores the machine has.

    python benchmarks/synth/swe.py --repo PATH_OR_URL --rev-range A..B [--max-candidates 40]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def synth(args, out: Path, cache: bool) -> dict:
    cmd = [sys.executable, "-m", "kiln.cli.main", "synth", "swe", "--repo", args.repo,
           "--out", str(out), "--max-tasks", str(args.max_tasks), "--jobs", str(args.jobs)]
    if args.rev_range:
        cmd += ["--rev-range", args.rev_range]
    if args.max_candidates:
        cmd += ["--max-candidates", str(args.max_candidates)]
    if not cache:
        cmd.append("--no-env-cache")
    t0 = time.monotonic()
    subprocess.run(cmd, check=True)
    report = json.loads((out / "report.json").read_text())
    report["bench_wall_seconds"] = time.monotonic() - t0
    return report


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repo", required=True)
    p.add_argument("--rev-range", default=None)
    p.add_argument("--max-candidates", type=int, default=40)
    p.add_argument("--max-tasks", type=int, default=1000)
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args = p.parse_args()
    cores = os.cpu_count() or 1
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for label, cache in (("cache on", True), ("cache off (baseline)", False)):
            r = synth(args, Path(tmp) / label.split()[1], cache)
            hours = r["bench_wall_seconds"] / 3600
            rows.append((label, r, r["funnel"]["kept"] / hours / cores,
                         r["candidates_verified"] / hours / cores))
    print(f"\n{'':22} {'kept':>5} {'candidates':>10} {'probes':>6} {'wall s':>7} "
          f"{'tasks/h/core':>12} {'candidates/h/core':>17}")
    for label, r, tasks, cands in rows:
        print(f"{label:22} {r['funnel']['kept']:5d} {r['candidates_verified']:10d} "
              f"{r['env_probes']:6d} {r['bench_wall_seconds']:7.0f} {tasks:12.1f} {cands:17.1f}")
    print("funnel (cache on):", json.dumps(rows[0][1]["funnel"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
