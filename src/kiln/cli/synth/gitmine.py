"""Candidate SWE tasks from a git repository's history: commits that change both source and
tests, split into the gold patch (everything but tests) and the test patch.

A candidate is a non-merge commit with a parent whose diff touches at least one Python source
file and at least one Python test file. Test files are recognised by path (a `test`/`tests`
folder, `test_*.py`, `*_test.py`, `conftest.py`); data files under a test folder belong to the
test patch too. Everything is read with plain git commands on a local clone, so the repository
is never checked out for mining.

Not covered: merged pull requests as units (each commit is its own candidate; a squash-merged
PR is one commit already) and non-Python projects.
"""
from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

_TEST_DIRS = {"test", "tests", "testing"}


class GitError(RuntimeError):
    pass


def git(repo: Path, *args: str, input: bytes | None = None) -> bytes:
    res = subprocess.run(["git", "-C", str(repo), *args], input=input, capture_output=True)
    if res.returncode != 0:
        raise GitError(f"git {' '.join(args[:3])}: {res.stderr.decode(errors='replace').strip()}")
    return res.stdout


def is_test_path(path: str) -> bool:
    p = PurePosixPath(path)
    if any(part in _TEST_DIRS for part in p.parts[:-1]):
        return True
    return p.name.startswith("test_") or p.name.endswith("_test.py") or p.name == "conftest.py"


def is_test_module(path: str) -> bool:
    """A file pytest collects tests from (by its default naming rules)."""
    name = PurePosixPath(path).name
    return name.endswith(".py") and (name.startswith("test_") or name.endswith("_test.py"))


@dataclass
class Candidate:
    commit: str
    parent: str
    subject: str
    body: str
    date: str
    source_files: list[str]
    test_files: list[str]
    other_files: list[str]

    @property
    def short(self) -> str:
        return self.commit[:10]

    @property
    def message(self) -> str:
        return (self.subject + ("\n\n" + self.body if self.body else "")).strip()


def resolve_repo(spec: str, cache: Path) -> Path:
    """A local repository folder as it is; a URL (or a folder that is not a work tree, such as a
    bare mirror) cloned once into `cache`."""
    path = Path(spec)
    if path.is_dir() and (path / ".git").exists():
        return path.resolve()
    dest = cache / re.sub(r"[^A-Za-z0-9._-]+", "_", spec.rstrip("/"))[-80:]
    if not dest.exists():
        cache.mkdir(parents=True, exist_ok=True)
        res = subprocess.run(["git", "clone", "--quiet", "--no-checkout", "--", spec, str(dest)],
                             capture_output=True, text=True)
        if res.returncode != 0:
            raise GitError(f"--repo {spec}: cannot clone: {res.stderr.strip()}")
    return dest.resolve()


def repo_name(repo: Path, spec: str) -> str:
    """`owner/name` from the origin URL when there is one, else the folder's name."""
    try:
        url = git(repo, "config", "--get", "remote.origin.url").decode().strip()
    except GitError:
        url = spec
    m = re.search(r"([^/:]+)/([^/]+?)(?:\.git)?/?$", url)
    return f"{m.group(1)}/{m.group(2)}" if m else Path(spec).name


def list_commits(repo: Path, rev_range: str | None) -> list[str]:
    """Non-merge commits of the range, newest first."""
    args = ["rev-list", "--no-merges", rev_range or "HEAD"]
    try:
        out = git(repo, *args).decode()
    except GitError as exc:
        raise GitError(f"--rev-range {rev_range}: {exc}") from None
    return out.split()


def candidate(repo: Path, commit: str) -> tuple[Candidate | None, str]:
    """The commit as a candidate, or None and why it is not one."""
    fields = git(repo, "show", "-s", "--format=%P%x00%s%x00%b%x00%cI", commit).decode()
    parents, subject, body, date = (fields.split("\0") + ["", "", "", ""])[:4]
    if not parents.split():
        return None, "root commit"
    parent = parents.split()[0]
    changed = git(repo, "diff", "--name-only", "--no-renames", parent, commit).decode().split("\n")
    changed = [c for c in changed if c]
    tests = [c for c in changed if is_test_path(c)]
    sources = [c for c in changed if c.endswith(".py") and not is_test_path(c)]
    others = [c for c in changed if c not in tests and c not in sources]
    if not sources:
        return None, "no source change"
    if not any(t.endswith(".py") for t in tests):
        return None, "no test change"
    return Candidate(commit, parent, subject.strip(), body.strip(), date.strip(), sources, tests,
                     others), ""


def diff(repo: Path, cand: Candidate, files: list[str]) -> str:
    if not files:
        return ""
    return git(repo, "diff", "--binary", "--no-renames", cand.parent, cand.commit, "--",
               *files).decode("utf-8", "replace")


def archive(repo: Path, commit: str) -> bytes:
    """The snapshot's files as a tar (no .git)."""
    return git(repo, "archive", "--format=tar", commit)


def read_file(repo: Path, commit: str, path: str) -> str | None:
    try:
        return git(repo, "show", f"{commit}:{path}").decode("utf-8", "replace")
    except GitError:
        return None


def list_files(repo: Path, commit: str) -> list[str]:
    return git(repo, "ls-tree", "-r", "--name-only", commit).decode().split("\n")


def bundle(repo: Path, dest: Path) -> None:
    """The whole history as one file the swe environment clones from."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_suffix(".tmp")
    git(repo, "bundle", "create", str(tmp.resolve()), "--all")
    tmp.replace(dest)
