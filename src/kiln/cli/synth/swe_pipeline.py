"""The steps of `kiln synth swe` (see `swe.py` for what each decides), run over candidates with
`--jobs` of them in flight; each candidate's verdict is appended to `state.jsonl` as soon as it
is known, so a killed run loses at most the candidates in flight."""
from __future__ import annotations

import asyncio
import json
import re
import time
from pathlib import Path

from . import gitmine, pyenv
from .report import Report
from .sandboxes import synth_sandboxes
from .swe import STEPS, leaks_patch, statement_describes, write_json_line


class SwePipeline:
    def __init__(self, args):
        self.args = args
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.repo = gitmine.resolve_repo(args.repo, self.out / ".cache" / "clones")
        self.name = args.repo_name or gitmine.repo_name(self.repo, args.repo)
        self.slug = re.sub(r"[^A-Za-z0-9]+", "-", self.name.split("/")[-1]).strip("-").lower()
        self.commits = gitmine.list_commits(self.repo, args.rev_range)
        self.report = Report(self.out, "swe", STEPS)
        self.env_cache = pyenv.EnvCache(self.out / ".cache" / "env", not args.no_env_cache)
        self.config = None  # the run's sandboxes (`run`)
        self.python = pyenv.sandbox_python()
        self.decided: dict[str, dict] = {}
        state = self.out / "state.jsonl"
        if state.is_file():
            for line in state.read_text().splitlines():
                if line.strip():
                    rec = json.loads(line)
                    self.decided[rec["commit"]] = rec
        self.kept_texts: list[str] = []
        tasks = self.out / "tasks.jsonl"
        if tasks.is_file():
            for line in tasks.read_text().splitlines():
                if line.strip():
                    rec = json.loads(line)
                    self.kept_texts.append(rec["problem_statement"] + "\n" + rec["patch"])
                    # Written before its state line: a run killed in between kept it.
                    self.decided.setdefault(rec["meta"]["commit"], {
                        "commit": rec["meta"]["commit"], "verdict": "kept", "reached": STEPS[1:]})
        self.kept = len(self.kept_texts)
        self.verified = 0
        self.drafter = None
        if args.statement_model:
            from .drafter import Drafter
            self.drafter = Drafter(args.statement_model, args.statement_model_name)

    # -- the run ---------------------------------------------------------------------------
    async def run(self) -> dict:
        bundle = self.out / "repos" / f"{self.slug}.bundle"
        if not bundle.exists():
            await asyncio.to_thread(gitmine.bundle, self.repo, bundle)
        (self.out / "solutions").mkdir(exist_ok=True)
        self.report.count("commits", len(self.commits))
        self.report.extra.update({"repo": self.name, "rev_range": self.args.rev_range,
                                  "runs": self.args.runs, "env_cache": not self.args.no_env_cache})
        with synth_sandboxes(self.args.backend, "synth", memory_bytes="2g", disk_bytes="2g",
                             pids=512, cpu=1.0, timeout_seconds=self.args.test_timeout) as config:
            self.config = config
            await self._run_candidates()
        self.report.extra.update({"env_probes": self.env_cache.misses,
                                  "env_cache_hits": self.env_cache.hits,
                                  "candidates_verified": self.verified})
        wall = time.monotonic() - self.report.started
        self.report.extra["tasks_per_hour"] = round(self.report.counts["kept"] * 3600 / wall, 1)
        return self.report.write()

    async def _run_candidates(self) -> None:
        sem = asyncio.Semaphore(self.args.jobs)
        in_flight: set[asyncio.Task] = set()
        done_count = 0
        limit = self.args.max_candidates
        for i, commit in enumerate(self.commits):
            if self.kept >= self.args.max_tasks or (limit is not None and self.verified >= limit):
                break
            if commit in self.decided:
                self._replay(self.decided[commit])
                continue
            cand, why = await asyncio.to_thread(gitmine.candidate, self.repo, commit)
            if cand is None:
                self._decide(commit, "candidates", why)
                continue
            self.report.count("candidates")
            self.verified += 1
            await sem.acquire()

            async def one(c=cand):
                try:
                    await self._verify(c)
                except Exception as exc:  # noqa: BLE001  one broken commit must not end the run
                    self._decide(c.commit, "environment", f"error: {type(exc).__name__}: {exc}")
                finally:
                    sem.release()
            task = asyncio.create_task(one())
            in_flight.add(task)
            task.add_done_callback(in_flight.discard)
            done_count = i + 1
            self.report.progress("verify", done_count, len(self.commits))
        if in_flight:
            await asyncio.gather(*in_flight)
        self.report.progress("verify", len(self.commits), len(self.commits))

    def _replay(self, rec: dict) -> None:
        """Count a commit decided by an earlier run as that run did."""
        reached = rec.get("reached", [])
        for step in reached:
            self.report.count(step)
        if rec["verdict"] != "kept":
            self.report.rejections.append({"item": rec["commit"][:10], "step": rec["step"],
                                           "reason": rec["reason"]})

    def _decide(self, commit: str, step: str, reason: str, reached: list[str] = ()) -> None:
        record = {"commit": commit, "verdict": "rejected", "step": step, "reason": reason,
                  "reached": list(reached)}
        write_json_line(self.out / "state.jsonl", record)
        if step != "candidates":  # non-candidates are counted, not itemised
            self.report.reject(commit[:10], step, reason)

    # -- one candidate ---------------------------------------------------------------------
    async def _verify(self, cand: gitmine.Candidate) -> None:
        reached = ["candidates"]
        project = pyenv.detect(lambda p: gitmine.read_file(self.repo, cand.parent, p),
                               gitmine.list_files(self.repo, cand.parent), self.python)
        probe = self.env_cache.get(project.key())
        if probe is None:
            probe = await self._probe(project)
            self.env_cache.put(project.key(), probe)
        why = pyenv.verdict(project, probe)
        if why:
            return self._decide(cand.commit, "environment", why, reached)
        self.report.count("environment")
        reached.append("environment")

        patch = gitmine.diff(self.repo, cand, cand.source_files + cand.other_files)
        test_patch = gitmine.diff(self.repo, cand, cand.test_files)
        after = set(gitmine.list_files(self.repo, cand.commit))
        modules = [t for t in cand.test_files if gitmine.is_test_module(t) and t in after]
        if not modules:
            return self._decide(cand.commit, "F2P non-empty", "no test module left to run",
                                reached)
        snapshot = await asyncio.to_thread(gitmine.archive, self.repo, cand.parent)
        base_runs, gold_runs = await asyncio.gather(
            self._runs(snapshot, [test_patch], modules, project),
            self._runs(snapshot, [test_patch, patch], modules, project))
        if isinstance(base_runs, str) or isinstance(gold_runs, str):
            return self._decide(cand.commit, "environment",
                                base_runs if isinstance(base_runs, str) else gold_runs, reached)
        tests = sorted(set().union(*(r.keys() for r in base_runs + gold_runs)))
        flaky = [t for t in tests if len({r.get(t) for r in base_runs}) > 1
                 or len({r.get(t) for r in gold_runs}) > 1]
        fixed = [t for t in tests if base_runs[0].get(t) != "passed"
                 and gold_runs[0].get(t) == "passed"]
        if not fixed:
            return self._decide(cand.commit, "F2P non-empty",
                                "no test fails before the fix and passes after it", reached)
        self.report.count("F2P non-empty")
        reached.append("F2P non-empty")
        f2p = [t for t in fixed if t not in flaky]
        p2p = [t for t in tests if t not in flaky and base_runs[0].get(t) == "passed"
               and gold_runs[0].get(t) == "passed"]
        if not f2p:
            return self._decide(cand.commit, "stable", "every fail-to-pass test is flaky: "
                                + ", ".join(flaky[:5]), reached)
        self.report.count("stable")
        reached.append("stable")

        statement, source = cand.message, "commit"
        if not statement_describes(cand.message):
            statement, source = await self._draft_statement(cand, f2p, patch)
            if statement is None:
                return self._decide(cand.commit, "statement", source, reached)
        self.report.count("statement")
        reached.append("statement")

        text = statement + "\n" + patch
        if self.kept_texts:
            from .filters import near_duplicates
            if len(self.kept_texts) in near_duplicates(self.kept_texts + [text]):
                return self._decide(cand.commit, "distinct", "near-duplicate of a kept task",
                                    reached)
        if self.kept >= self.args.max_tasks:
            # Other jobs filled the quota meanwhile: not written and not decided, so a run
            # with a larger --max-tasks picks it up again.
            self.report.extra["verified_beyond_quota"] = \
                self.report.extra.get("verified_beyond_quota", 0) + 1
            return
        self.kept_texts.append(text)
        self.kept += 1
        self.report.count("distinct")
        self.report.count("kept")
        reached += ["distinct", "kept"]
        self._write_task(cand, patch, test_patch, f2p, p2p, flaky, statement, source, project,
                         probe)
        write_json_line(self.out / "state.jsonl",
                        {"commit": cand.commit, "verdict": "kept", "reached": reached})

    async def _probe(self, project: pyenv.PythonProject) -> dict:
        from kiln.services.sandbox.factory import make_sandbox
        async with make_sandbox(self.config) as sandbox:
            await sandbox.write_file(".kiln-probe.py", pyenv.PROBE.encode())
            res = await sandbox.exec(["python3", ".kiln-probe.py", *project.dependencies],
                                     timeout=60)
        if not res.ok:
            return {"python": "0", "missing": [], "pytest": None, "error": res.stderr[-500:]}
        return json.loads(res.stdout.strip().splitlines()[-1])

    async def _runs(self, snapshot: bytes, patches: list[str], modules: list[str],
                    project: pyenv.PythonProject) -> list[dict[str, str]] | str:
        """Outcomes of `--runs` runs of `modules` in one sandbox holding the snapshot with
        `patches` applied, or why the state could not be built."""
        from kiln.services.sandbox.environments.verifier import run_pytest
        from kiln.services.sandbox.factory import make_sandbox
        async with make_sandbox(self.config) as sandbox:
            await sandbox.write_file(".kiln-snapshot.tar", snapshot)
            res = await sandbox.exec("tar -xf .kiln-snapshot.tar --no-same-owner && "
                                     "rm .kiln-snapshot.tar", timeout=120)
            if not res.ok:
                return f"unpacking the snapshot failed: {res.stderr[-500:]}"
            for k, patch in enumerate(patches):
                if not patch:
                    continue
                await sandbox.write_file(f".kiln-{k}.patch", patch.encode())
                res = await sandbox.exec(f"git apply .kiln-{k}.patch && rm .kiln-{k}.patch",
                                         timeout=60)
                if not res.ok:
                    return f"{'test' if k == 0 else 'gold'} patch does not apply: " \
                           f"{res.stderr[-500:]}"
            runs = []
            for _ in range(self.args.runs):
                run = await run_pytest(sandbox, modules, pythonpath=project.pythonpath,
                                       timeout=self.args.test_timeout)
                if run.timed_out:
                    return f"tests timed out after {self.args.test_timeout:g} s"
                runs.append(run.outcomes)
            return runs

    async def _draft_statement(self, cand, f2p: list[str], patch: str
                               ) -> tuple[str | None, str]:
        if self.drafter is None:
            return cand.message, "needs-drafting"
        prompt = ("Write the GitHub issue a user would have filed before this change was made. "
                  "Describe the wrong behaviour and what is expected, as a user sees it; do "
                  "not describe or quote the fix.\n\n"
                  f"Commit subject: {cand.subject}\nTests that fail before the change and pass "
                  "after it:\n" + "\n".join(f"- {t}" for t in f2p[:20]))
        try:
            text = await asyncio.to_thread(
                self.drafter.complete, [{"role": "user", "content": prompt}],
                max_tokens=400, temperature=0.2)
        except Exception as exc:  # noqa: BLE001  the drafter is another process: say why
            return None, f"statement: drafting failed: {exc}"
        text = text.strip()
        if not text:
            return None, "statement: the model returned an empty statement"
        if leaks_patch(text, patch):
            return None, "statement: the drafted statement quotes the gold patch"
        return text, "drafted"

    def _write_task(self, cand, patch, test_patch, f2p, p2p, flaky, statement, source, project,
                    probe) -> None:
        instance_id = f"{self.slug}-{cand.short}"
        record = {
            "instance_id": instance_id, "type": "swe", "repo": f"repos/{self.slug}.bundle",
            "repo_name": self.name, "base_commit": cand.parent, "patch": patch,
            "test_patch": test_patch, "FAIL_TO_PASS": f2p, "PASS_TO_PASS": p2p,
            "problem_statement": statement, "created_at": cand.date,
            "test_runner": "pytest", "pythonpath": project.pythonpath,
            "environment": {**project.spec(), "python": probe.get("python"),
                            "pytest": probe.get("pytest")},
            "timeout_seconds": self.args.test_timeout,
            "meta": {"commit": cand.commit, "statement_source": source, "flaky_tests": flaky},
        }
        (self.out / "solutions" / f"{instance_id}.patch").write_text(patch)
        write_json_line(self.out / "tasks.jsonl", record)
