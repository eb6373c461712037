"""`kiln synth swe`: SWE tasks mined from a repository's history and verified by running tests.

For each candidate commit (`gitmine.py`), newest first, until `--max-tasks` are kept:

1. environment: detect how the parent snapshot runs its tests (`pyenv.py`) and probe a sandbox
   for it (cached by what the probe depends on);
2. the task's base is the parent; its gold patch the commit's non-test diff, its test patch the
   test diff;
3. run the test modules the test patch touches at base + test patch and at base + test patch +
   gold patch, `--runs` times each in one sandbox per state (so a test that depends on what an
   earlier run left behind shows up as flaky); FAIL_TO_PASS = failed in every base run and
   passed in every gold run, PASS_TO_PASS = passed in every run; a test whose outcome changed
   between runs of one state is flaky and dropped; the task is kept if FAIL_TO_PASS is not empty;
4. problem statement: the commit message when it describes the change, otherwise drafted by
   `--statement-model` (an OpenAI-compatible endpoint) from the subject and the failing tests'
   names, never from the patch (a draft quoting a line of the gold patch is rejected); without a
   model such tasks keep the message and are marked `meta.statement_source: needs-drafting`;
5. near-duplicates (statement + patch) dropped.

Out: `DIR/tasks.jsonl` (SWE-bench field names plus what Kiln's swe environment needs; it loads
the file as it is), `DIR/solutions/<id>.patch` (the gold patches, for `kiln sandbox verify`),
`DIR/repos/<name>.bundle`, `DIR/state.jsonl` (every commit's verdict: a re-run skips decided
commits), `DIR/report.json`, `DIR/funnel.png`, `DIR/rejections.jsonl`.

Not covered: difficulty filtering by the policy's pass rate and SFT export (no agent is run
here), non-Python repositories.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from kiln.cli.exits import Exit

STEPS = ["commits", "candidates", "environment", "F2P non-empty", "stable", "statement", "distinct",
         "kept"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--repo", required=True, help="a local git repository, or a URL to clone")
    p.add_argument("--repo-name", default=None, help="owner/name recorded in each task "
                   "(default: from the origin URL, else the folder's name)")
    p.add_argument("--rev-range", default=None, help="commits to mine, e.g. v1.0..main "
                   "(default: the whole history of HEAD)")
    p.add_argument("--max-tasks", type=int, default=50, help="stop after this many kept tasks")
    p.add_argument("--max-candidates", type=int, default=None,
                   help="stop after running tests for this many candidates")
    p.add_argument("--runs", type=int, default=3, help="runs per state to detect flaky tests")
    p.add_argument("--jobs", type=int, default=1, help="candidates verified concurrently")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--backend", choices=("bubblewrap", "docker"), default="bubblewrap",
                   help="sandbox backend for the checks (default bubblewrap)")
    p.add_argument("--test-timeout", type=float, default=600.0,
                   help="seconds for one run of a candidate's tests (default 600)")
    p.add_argument("--no-env-cache", action="store_true",
                   help="probe the environment for every snapshot instead of once per "
                        "dependency set")
    p.add_argument("--statement-model", default=None,
                   help="OpenAI-compatible base URL (…/v1) drafting statements for commits "
                        "whose message does not describe the problem")
    p.add_argument("--statement-model-name", default="default", help="model name to request")


def run(args: argparse.Namespace) -> int:
    from .swe_pipeline import SwePipeline
    if args.max_tasks < 1 or args.runs < 1 or args.jobs < 1:
        print("kiln synth swe: --max-tasks, --runs and --jobs must be at least 1", file=sys.stderr)
        return Exit.REFUSED
    try:
        pipeline = SwePipeline(args)
    except (ValueError, RuntimeError) as exc:
        print(f"kiln synth swe: {exc}", file=sys.stderr)
        return Exit.REFUSED
    summary = asyncio.run(pipeline.run())
    f = summary["funnel"]
    print(f"kiln synth swe: {f['kept']} tasks kept of {f['candidates']} candidates "
          f"({f['commits']} commits) in {summary['wall_seconds']:.0f} s -> {args.out}/tasks.jsonl")
    return 0


def statement_describes(message: str) -> bool:
    """Whether a commit message can serve as the problem statement: at least five words once
    issue references are stripped, and not a chore (formatting, version bumps, merges)."""
    import re
    subject = message.strip().splitlines()[0] if message.strip() else ""
    text = re.sub(r"(#\d+|\bgh-\d+|\b[Ii]ssue \d+:?)", " ", message)
    words = re.findall(r"[A-Za-z_][\w.()]*", text)
    chore = re.match(r"(?i)\s*(merge|bump|release|version|run the formatter|format|lint|typo|"
                     r"sort|revert|wip|update (the )?(changelog|docs|readme))\b", subject)
    return len(words) >= 5 and not chore


def leaks_patch(statement: str, patch: str, min_len: int = 25) -> bool:
    """A statement that quotes an added line of the gold patch gives the fix away."""
    for line in patch.splitlines():
        if line.startswith("+") and not line.startswith("+++"):
            code = line[1:].strip()
            if len(code) >= min_len and code in statement:
                return True
    return False


def write_json_line(path: Path, record: dict) -> None:
    with path.open("a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
