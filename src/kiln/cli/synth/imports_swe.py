"""SWE-bench-style records into Kiln swe tasks (see `imports.py`); verification happens there."""
from __future__ import annotations

import json
from pathlib import Path

from . import gitmine, pyenv
from .imports import safe_id

REQUIRED = ("instance_id", "repo", "base_commit", "patch", "FAIL_TO_PASS", "problem_statement")


def read_records(path: Path) -> list[dict]:
    text = path.read_text()
    if path.suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not valid JSON ({exc.msg})") from None
        if not isinstance(data, list):
            raise ValueError(f"{path}: expected a JSON list of instances")
        return data
    records = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None
    return records


def find_repo(repos: Path, name: str) -> Path | None:
    owner, _, short = name.partition("/")
    for candidate in (repos / f"{owner}__{short}.bundle", repos / f"{owner}__{short}",
                      repos / owner / short, repos / (short or owner)):
        if candidate.exists():
            return candidate
    return None


def convert_swe_bench(args, out: Path, report) -> list[tuple[dict, str, bytes]]:
    repos = Path(args.repos)
    if not repos.is_dir():
        raise ValueError(f"--repos {repos}: not a folder")
    records = read_records(Path(args.source))[:args.max_tasks]
    report.count("records", len(records))
    items, bundled = [], {}
    for n, rec in enumerate(records, 1):
        rid = str(rec.get("instance_id") or f"record-{n}") if isinstance(rec, dict) else f"record-{n}"
        missing = [f for f in REQUIRED if not isinstance(rec, dict) or not rec.get(f)]
        if missing:
            report.reject(rid, "well-formed", f"missing field(s) {', '.join(missing)}")
            continue
        report.count("well-formed")
        name = str(rec["repo"])
        if name not in bundled:
            src = find_repo(repos, name)
            bundled[name] = None
            if src is not None:
                dest = out / "repos" / f"{safe_id(name.replace('/', '__'))}.bundle"
                if not dest.exists():
                    work = gitmine.resolve_repo(str(src), out / ".cache" / "clones")
                    gitmine.bundle(work, dest)
                bundled[name] = (dest, gitmine.resolve_repo(str(src), out / ".cache" / "clones"))
        if bundled[name] is None:
            report.reject(rid, "environment", f"repo: no local copy of {name} under {repos} "
                          f"(looked for {name.replace('/', '__')}.bundle and folders)")
            continue
        dest, work = bundled[name]
        paths = gitmine.list_files(work, rec["base_commit"]) if _has(work, rec["base_commit"]) \
            else []
        if not paths:
            report.reject(rid, "environment", f"base_commit {rec['base_commit']} is not in {name}")
            continue
        project = pyenv.detect(lambda p: gitmine.read_file(work, rec["base_commit"], p), paths)
        record = {k: v for k, v in rec.items()
                  if k in ("base_commit", "patch", "test_patch", "FAIL_TO_PASS", "PASS_TO_PASS",
                           "problem_statement", "created_at", "hints_text", "version",
                           "environment_setup_commit")}
        record.update({"id": safe_id(rid), "type": "swe", "repo": str(dest.relative_to(out)),
                       "repo_name": name, "test_runner": "pytest",
                       "pythonpath": project.pythonpath, "environment": project.spec(),
                       "timeout_seconds": args.timeout})
        items.append((record, f"{record['id']}.patch", str(rec["patch"]).encode()))
    return items


def _has(repo: Path, commit: str) -> bool:
    try:
        gitmine.git(repo, "cat-file", "-e", f"{commit}^{{commit}}")
        return True
    except gitmine.GitError:
        return False
