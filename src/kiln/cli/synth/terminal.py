"""`kiln synth terminal`: terminal tasks drafted by a model, built and refined in a sandbox.

    kiln synth terminal (--seeds FILE | --pages DIR) --model-url URL [--model NAME]
                        [--max-rounds 3] [--runs 3] [--max-tasks N] --out DIR

For each seed (a scenario, or a technical page) the model drafts a task as one JSON object:
`description` (what a user asks, not how it is tested), `files` and `setup` (the environment),
`test_script` (exit 0 exactly when the task is done) and `solution` (the reference). The
draft is then checked, in funnel order:

1. drafted: the reply holds a JSON object with those fields;
2. exploit-free: the reference does not read or edit the grader's files;
3. built: the files and the set-up install in a sandbox;
4. reference passes: the reference solution makes the test script pass;
5. null fails: with nothing done (an agent that gave up) the test fails, every run;
6. stable: the reference passes in each of `--runs` fresh sandboxes;
7. distinct: not a near-duplicate (MinHash over description + test) of a kept task.

A draft that fails 1-6 goes back to the model with what failed and the output's tail, up to
`--max-rounds` drafts per seed: the refine loop. Kept tasks are written as Kiln terminal tasks
(`OUT/tasks.jsonl`, `OUT/solutions/<id>.sh`) and as Terminal-Bench-style folders
(`OUT/tasks/<id>/`, see `terminal_export.py`). A re-run skips the seeds already decided.
"""
from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from kiln.cli.exits import Exit

from .filters import near_duplicates
from .ledger import Ledger
from .report import Report
from .sandboxes import synth_sandboxes
from .swe import write_json_line
from .terminal_export import check_draft, exploit, write_folder

STEPS = ["seeds", "drafted", "exploit-free", "built", "reference passes", "null fails", "stable",
         "distinct", "kept"]

SYSTEM = """You write tasks that train AI agents to work in a Linux terminal.
Reply with ONE JSON object (in a ```json block) with these keys:
- "description": the request, as a user would write it to the agent: what must be true when it
  is done (file names, formats). Do not describe the test.
- "files": an object mapping relative paths to the text of files that exist before the agent
  starts (may be empty).
- "setup": a POSIX sh script run in the working folder before the agent starts (may be "").
- "test_script": a POSIX sh script run in the working folder after the agent finishes; it must
  exit 0 exactly when the task is done, and fail when nothing was done.
- "solution": a POSIX sh script that completes the task.
The machine is offline: use only POSIX tools, coreutils, grep/sed/awk and python3 (standard
library). All paths are relative to the working folder."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--seeds", type=Path, help="scenarios, one per line (text or JSON)")
    src.add_argument("--pages", type=Path, help="folder of technical pages (md/html/txt)")
    p.add_argument("--model-url", required=True,
                   help="OpenAI-compatible base URL (…/v1) of the drafting model")
    p.add_argument("--model", default="default", help="model name to request")
    p.add_argument("--max-rounds", type=int, default=3, help="drafts per seed (refine loop)")
    p.add_argument("--runs", type=int, default=3, help="sandbox runs for the stability check")
    p.add_argument("--max-tasks", type=int, default=None, help="stop after this many kept tasks")
    p.add_argument("--temperature", type=float, default=0.7, help="sampling temperature")
    p.add_argument("--out", required=True, type=Path, help="output folder")
    p.add_argument("--backend", choices=("bubblewrap", "docker"), default="bubblewrap",
                   help="sandbox backend for the checks (default bubblewrap)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per sandbox command")


def run(args: argparse.Namespace) -> int:
    from .terminal_seeds import load_pages, load_seeds
    if args.max_rounds < 1 or args.runs < 1:
        print("kiln synth terminal: --max-rounds and --runs must be at least 1", file=sys.stderr)
        return Exit.REFUSED
    try:
        seeds = load_seeds(args.seeds) if args.seeds else load_pages(args.pages)
    except ValueError as exc:
        print(f"kiln synth terminal: {exc}", file=sys.stderr)
        return Exit.REFUSED
    summary = asyncio.run(TerminalPipeline(args).run(seeds))
    f = summary["funnel"]
    print(f"kiln synth terminal: {f['kept']} tasks kept of {f['seeds']} seeds in "
          f"{summary['wall_seconds']:.0f} s -> {args.out}/tasks.jsonl")
    return 0


class Failed(Exception):
    """A draft failed `step`; `feedback` goes back to the model."""

    def __init__(self, step: str, feedback: str):
        super().__init__(feedback)
        self.step = step
        self.feedback = feedback


class TerminalPipeline:
    def __init__(self, args):
        from .drafter import Drafter
        self.args = args
        self.out = Path(args.out)
        self.report = Report(self.out, "terminal", STEPS)
        self.ledger = Ledger(self.out, self.report)
        self.drafter = Drafter(args.model_url, args.model)
        self.config = None  # the run's sandboxes (`run`)
        self.kept_texts: list[str] = []
        self.report.extra["rounds_to_keep"] = {}
        self.report.extra["model"] = args.model_url

    async def run(self, seeds) -> dict:
        (self.out / "solutions").mkdir(parents=True, exist_ok=True)
        with synth_sandboxes(self.args.backend, "synth-terminal", memory_bytes="1g",
                             disk_bytes="1g", pids=256, timeout_seconds=self.args.timeout) as config:
            self.config = config
            kept = 0
            for n, seed in enumerate(seeds, 1):
                self.report.progress("draft+verify", n - 1, len(seeds))
                if self.args.max_tasks is not None and kept >= self.args.max_tasks:
                    break
                if seed.id in self.ledger:
                    rec = self.ledger.replay(seed.id)
                    if rec["verdict"] == "kept":
                        kept += 1
                        self.kept_texts.append(rec["text"])
                    continue
                self.report.count("seeds")
                try:
                    kept += await self._seed(seed)
                except Exception as exc:  # noqa: BLE001  one broken seed must not end the run
                    self.ledger.rejected(seed.id, "built", f"error: {type(exc).__name__}: "
                                                           f"{exc}"[:500], ["seeds"])
            self.report.progress("draft+verify", len(seeds), len(seeds))
        return self.report.write()

    async def _seed(self, seed) -> int:
        messages = [{"role": "system", "content": SYSTEM},
                    {"role": "user", "content": self._ask(seed)}]
        failure = Failed("drafted", "no draft")
        for round_ in range(1, self.args.max_rounds + 1):
            try:
                reply = await asyncio.to_thread(self.drafter.complete, messages,
                                                temperature=self.args.temperature)
            except Exception as exc:  # noqa: BLE001  the model is another process: say why, go on
                self.ledger.rejected(seed.id, "drafted", f"model error: {exc}"[:500], ["seeds"])
                return 0
            reached = ["seeds"]
            try:
                record, solution = await self._check(seed, reply, reached)
            except Failed as exc:
                failure = exc
                messages += [{"role": "assistant", "content": reply},
                             {"role": "user", "content": self._feedback(exc)}]
                continue
            text = record["description"] + "\n" + record["test_script"]
            if len(self.kept_texts) in near_duplicates(self.kept_texts + [text]):
                for step in reached[1:]:
                    self.report.count(step)
                self.ledger.rejected(seed.id, "distinct", "a near-duplicate of a kept task",
                                     reached)
                return 0
            reached += ["distinct", "kept"]
            (self.out / "solutions" / f"{record['id']}.sh").write_text(solution)
            write_folder(self.out / "tasks", record, solution)
            write_json_line(self.out / "tasks.jsonl", record)
            for step in reached[1:]:
                self.report.count(step)
            self.kept_texts.append(text)
            rounds = self.report.extra["rounds_to_keep"]
            rounds[str(round_)] = rounds.get(str(round_), 0) + 1
            self.ledger.kept(seed.id, reached, text=text, rounds=round_)
            return 1
        for step in _reached_before(failure.step)[1:]:
            self.report.count(step)
        self.ledger.rejected(seed.id, failure.step,
                             f"after {self.args.max_rounds} drafts: {failure.feedback}"[:500],
                             _reached_before(failure.step))
        return 0

    def _ask(self, seed) -> str:
        if self.args.pages:
            return (f"Write one terminal task grounded in this page, titled {seed.title!r}. The "
                    f"task should exercise what the page teaches.\n\n{seed.text}")
        return f"Write one terminal task for this scenario:\n\n{seed.text}"

    @staticmethod
    def _feedback(failure: Failed) -> str:
        return (f"The task failed the check `{failure.step}`: {failure.feedback}\n"
                "Fix the task and reply with the whole corrected JSON object.")

    async def _check(self, seed, reply: str, reached: list[str]) -> tuple[dict, str]:
        """The verified record and reference of a draft, or `Failed` at the first check that
        does not hold; `reached` collects the checks passed."""
        from .drafter import extract_json
        from kiln.services.sandbox.environments.tasks import TaskSetError, parse_task
        from kiln.services.sandbox.runner import run_solution
        try:
            draft = extract_json(reply)
        except ValueError as exc:
            raise Failed("drafted", str(exc)) from None
        problem = check_draft(draft)
        if problem:
            raise Failed("drafted", problem)
        record = {"id": seed.id, "type": "terminal", "description": draft["description"].strip(),
                  "setup": draft.get("setup") or "", "files": draft.get("files") or {},
                  "test_script": draft["test_script"], "solution_commands": [draft["solution"]],
                  "timeout_seconds": self.args.timeout}
        try:
            task = parse_task(record, f"draft for {seed.id}")
        except TaskSetError as exc:
            raise Failed("drafted", str(exc)) from None
        reached.append("drafted")
        why = exploit(draft)
        if why:
            raise Failed("exploit-free", why)
        reached.append("exploit-free")
        solution = draft["solution"].rstrip("\n") + "\n"
        base = self.out.resolve()
        for run_ in range(self.args.runs):
            try:
                gold = await run_solution(self.config, task, base, solution.encode())
            except (RuntimeError, OSError, ValueError) as exc:
                raise Failed("built", str(exc)[-1500:]) from None
            if run_ == 0:
                reached.append("built")
            if gold.reward != 1.0:
                tail = "\n".join(gold.output.strip().splitlines()[-15:])
                if run_ == 0:
                    raise Failed("reference passes",
                                 f"with the reference solution the test fails:\n{tail}")
                raise Failed("stable", f"the reference passed, then failed on run {run_ + 1} "
                                       f"of {self.args.runs}:\n{tail}")
            if run_ == 0:
                reached.append("reference passes")
            null = await run_solution(self.config, task, base, None)
            if null.reward == 1.0:
                raise Failed("null fails", "the test passes when the agent does nothing; it "
                                           "must check the task's result"
                             + (f" (on run {run_ + 1} of {self.args.runs})" if run_ else ""))
            if run_ == 0:
                reached.append("null fails")
        reached.append("stable")
        return record, solution


def _reached_before(step: str) -> list[str]:
    return STEPS[:STEPS.index(step)]
