"""`kiln synth import`: read the field's task formats, re-verify every task in Kiln's sandboxes
(the reference passes, doing nothing fails) and write the verified ones as a Kiln task set.

- `swe-bench FILE --repos DIR`: SWE-bench / SWE-Gym JSONL (or a JSON list); SWE-smith and R2E
  exports with the same field names read the same way. `repo` ("owner/name") is found under
  `--repos` as `owner__name.bundle`, `owner__name/`, `owner/name/` or `name/` and copied into
  OUT/repos as a bundle. FAIL_TO_PASS/PASS_TO_PASS must be pytest ids (Django-style unittest
  ids fail the gold check and are rejected with the log).
- `terminal-bench DIR`: one folder per task with `task.yaml` (`instruction`, or the older
  `descriptions`), `Dockerfile`, `run-tests.sh`, `solution.sh` and `tests/`. Sandboxes are
  offline and have no image builds: the Dockerfile's `COPY` lines become task files and its
  `RUN` lines the set-up; the test files are written by the test script into the verifier's
  hidden folder only at grading; installer lines of run-tests.sh (apt-get, pip, uv, curl) are
  dropped and `pytest` runs as the sandbox's `python3 -m pytest`; `/app` becomes /workspace.
  A task that needs what this cannot give (a base image's packages, the network) fails its
  re-verification and is rejected with the reason.

Out: `OUT/tasks.jsonl`, `OUT/solutions/`, `OUT/report.json`, `OUT/rejections.jsonl`; a re-run
skips the ids already written.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
from pathlib import Path

from kiln.cli.exits import Exit

from .report import Report
from .sandboxes import synth_sandboxes
from .swe import write_json_line

STEPS = ["records", "well-formed", "environment", "reference passes", "null fails", "kept"]


def add_arguments(p: argparse.ArgumentParser, fmt: str) -> None:
    p.add_argument("source", help="JSONL file" if fmt == "swe-bench" else "folder of task folders")
    if fmt == "swe-bench":
        p.add_argument("--repos", required=True, help="folder holding the local repositories")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--backend", choices=("bubblewrap", "docker"), default="bubblewrap",
                   help="sandbox backend for the checks (default bubblewrap)")
    p.add_argument("--max-tasks", type=int, default=None, help="stop after this many records")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per verifier run")


def run(args: argparse.Namespace) -> int:
    source = Path(args.source)
    if not source.exists():
        print(f"kiln synth import: {source} does not exist", file=sys.stderr)
        return Exit.REFUSED
    out = Path(args.out)
    report = Report(out, f"import {args.import_format}", STEPS)
    (out / "solutions").mkdir(exist_ok=True)
    if args.import_format == "swe-bench":
        from .imports_swe import convert_swe_bench as convert
    else:
        from .imports_terminal import convert_terminal_bench as convert
    try:
        items = convert(args, out, report)
    except ValueError as exc:
        print(f"kiln synth import: {exc}", file=sys.stderr)
        return Exit.REFUSED
    done = _written_ids(out / "tasks.jsonl")
    asyncio.run(_verify_all(args, out, report, items, done))
    summary = report.write()
    print(f"kiln synth import {args.import_format}: {summary['funnel']['kept']} of "
          f"{summary['funnel']['records']} tasks verified -> {out}/tasks.jsonl")
    return 0


def _written_ids(path: Path) -> set[str]:
    if not path.is_file():
        return set()
    return {json.loads(line)["id"] for line in path.read_text().splitlines() if line.strip()}


async def _verify_all(args, out: Path, report: Report, items, done: set[str]) -> None:
    """`items`: (record, solution name, solution bytes) of well-formed tasks, converted."""
    from kiln.services.sandbox.environments.tasks import TaskSetError, parse_task
    from kiln.services.sandbox.runner import run_solution
    with synth_sandboxes(args.backend, "synth-import", memory_bytes="2g", disk_bytes="2g",
                         pids=512, timeout_seconds=args.timeout) as config:
        for n, (record, solution_name, solution) in enumerate(items, 1):
            report.progress("verify", n, len(items))
            rid = record["id"]
            if rid in done:
                for step in STEPS[1:]:
                    report.count(step)
                continue
            try:
                task = parse_task(record, f"record {rid}")
            except TaskSetError as exc:
                report.reject(rid, "environment", str(exc))
                continue
            report.count("environment")
            try:
                gold = await run_solution(config, task, out.resolve(), solution)
            except (RuntimeError, OSError, ValueError) as exc:
                report.reject(rid, "reference passes", f"set-up or reference failed: {exc}")
                continue
            if gold.reward != 1.0:
                tail = gold.output.strip().splitlines()[-3:]
                report.reject(rid, "reference passes",
                              f"reference scores {gold.reward:g}: {' | '.join(tail)}"[:500])
                continue
            report.count("reference passes")
            null = await run_solution(config, task, out.resolve(), None)
            if null.reward == 1.0:
                report.reject(rid, "null fails", "passes with no solution applied")
                continue
            report.count("null fails")
            (out / "solutions" / solution_name).write_bytes(solution)
            write_json_line(out / "tasks.jsonl", record)
            report.count("kept")


def safe_id(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-") or "task"
