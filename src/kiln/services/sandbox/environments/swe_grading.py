"""Grade a SWE episode the SWE-bench way: the candidate's diff onto a clean checkout.

The workspace the agent leaves is not trusted in any part, its `.git` included (hooks, config,
a moved HEAD, a rewritten index), so:

1. every process the agent left is killed;
2. the candidate's diff is taken against the task's commit with a git folder copied from the
   original repository (`--git-dir`), with no user or system config: only the working tree is
   read;
3. the workspace is emptied and the original repository unpacked into it;
4. the diff is applied there (`git apply`, which itself refuses paths outside the tree and
   writes beyond symlinks), and git lists what it changed. A change to a protected path (tests,
   conftest.py, runner shadows, .pth files, ini files) refuses the candidate (reward 0, flag
   `tests_modified`), as does a symlink pointing into a protected path or out of the tree: test
   files and the harness are therefore exactly the task's version when the tests run;
5. the task's `test_patch` is applied, and the tests run through `verifier.py` (`python3 -I`,
   outcomes from the runner's own report).

The original repository is a fresh checkout of the commit from the repository on the service's
host (`HostRepo`), or, for a task run in its own image, the repository inside that image
(`ImageRepo`), which the sandbox user cannot write (checked when the task is set up), so that
nothing the agent did reaches it.

Not covered: files the repository's `.gitignore` hides are not part of the diff (as in
SWE-bench, whose candidates are diffs): such files never reach the graded checkout.
"""
from __future__ import annotations

import asyncio
import fnmatch
import io
import posixpath
import shlex
import subprocess
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

from kiln.env import SandboxHandle

GRADE_DIR = ".kiln-grade"
#: Largest candidate diff graded; a larger one is refused (a real fix is far smaller).
MAX_DIFF_BYTES = 8 << 20
# Git sees only what the command line says: no global or system config, no hooks, no
# filesystem monitor, no pager (the agent controls $HOME, which is the workspace).
GIT = ("env GIT_CONFIG_NOSYSTEM=1 GIT_CONFIG_GLOBAL=/dev/null HOME=/nonexistent GIT_PAGER=cat "
       "git -c core.hooksPath=/dev/null -c core.fsmonitor=false -c core.quotepath=false")
SYMLINK_MODE = "120000"


class Refused(Exception):
    """The candidate cannot be graded: reward 0 with `flag`, tests not run."""

    def __init__(self, message: str, flag: str) -> None:
        super().__init__(message)
        self.flag = flag


def checkout(repo: Path, commit: str, dest: Path) -> None:
    if not repo.exists():
        raise FileNotFoundError(f"repo: {repo} does not exist")
    run = lambda *a: subprocess.run(a, check=True, capture_output=True, text=True)  # noqa: E731
    run("git", "clone", "--quiet", "--no-hardlinks", "--", str(repo), str(dest))
    run("git", "-C", str(dest), "-c", "advice.detachedHead=false", "checkout", "--quiet", commit)


def _tar(folder: Path) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        tar.add(folder, arcname=".")
    return buf.getvalue()


def checkout_tar(repo: Path, commit: str) -> bytes:
    """A tar of a fresh checkout of `commit` (its .git included)."""
    with tempfile.TemporaryDirectory() as tmp:
        dest = Path(tmp) / "repo"
        checkout(repo, commit, dest)
        return _tar(dest)


def is_protected(rel: str, patterns: list[str]) -> bool:
    return any(fnmatch.fnmatch(rel, p) for p in patterns)


def link_refused(link: str, target: str, patterns: list[str]) -> bool:
    """Whether a symlink at `link` (relative to the root) pointing at `target` reaches a
    protected path (the path itself, or anything under it) or leaves the tree."""
    if target.startswith("/"):
        return True
    resolved = posixpath.normpath(posixpath.join(posixpath.dirname(link), target))
    if resolved == ".." or resolved.startswith("../"):
        return True
    return is_protected(resolved, patterns) or is_protected(resolved + "/x", patterns)


@dataclass
class Change:
    old_mode: str
    new_mode: str
    new_sha: str
    status: str
    path: str


def parse_raw(raw: str) -> list[Change]:
    """`git diff --raw -z --no-renames` output as changes."""
    fields = raw.split("\0")
    changes = []
    for i in range(0, len(fields) - 1, 2):
        head, path = fields[i], fields[i + 1]
        if not head.startswith(":"):
            raise ValueError(f"unexpected git diff --raw entry {head!r}")
        old_mode, new_mode, _old_sha, new_sha, status = head[1:].split(" ")
        changes.append(Change(old_mode, new_mode, new_sha, status, path))
    return changes


async def _sh(sandbox: SandboxHandle, cmd: str, timeout: float, what: str) -> str:
    res = await sandbox.exec(cmd, timeout=timeout)
    if not res.ok or res.truncated:
        raise Refused(f"{what} failed (exit {res.exit_code}): {res.stderr[-2000:]}",
                      "verifier_error")
    return res.stdout


@dataclass
class HostRepo:
    """The original repository: a fresh checkout of `commit` from `repo` on this host."""

    repo: Path
    commit: str

    async def put(self, sandbox: SandboxHandle, dest: str, timeout: float) -> None:
        """A tar of it at `dest` in the sandbox's workspace."""
        tar = await asyncio.to_thread(checkout_tar, self.repo, self.commit)
        await sandbox.write_file(dest, tar)


@dataclass
class ImageRepo:
    """The original repository: the folder `path` of the sandbox's image, which the sandbox
    user cannot write."""

    path: str

    async def put(self, sandbox: SandboxHandle, dest: str, timeout: float) -> None:
        await _sh(sandbox, f"mkdir -p {shlex.quote(posixpath.dirname(dest))} && tar -cf "
                  f"{shlex.quote(dest)} -C {shlex.quote(self.path)} .", timeout,
                  "copying the image's repository")


async def candidate_diff(sandbox: SandboxHandle, original: HostRepo | ImageRepo, commit: str,
                         timeout: float) -> bytes:
    """The agent's changes against `commit`, read with a trusted git folder."""
    await sandbox.exec(["rm", "-rf", GRADE_DIR], timeout=30)
    await original.put(sandbox, f"{GRADE_DIR}/repo.tar", timeout)
    git = f"{GIT} --git-dir={GRADE_DIR}/clean/.git --work-tree=."
    await _sh(sandbox, f"mkdir {GRADE_DIR}/clean && tar -xf {GRADE_DIR}/repo.tar -C "
              f"{GRADE_DIR}/clean --no-same-owner && rm {GRADE_DIR}/repo.tar && "
              f"{git} add -A -- . ':(exclude){GRADE_DIR}' && "
              f"{git} diff --cached --binary --no-renames --no-ext-diff --no-textconv "
              f"{commit} > {GRADE_DIR}/candidate.patch", timeout, "reading the candidate's diff")
    try:
        diff = await sandbox.read_file(f"{GRADE_DIR}/candidate.patch", MAX_DIFF_BYTES + 1)
    except (OSError, ValueError) as exc:
        raise Refused(f"the candidate's diff cannot be read: {exc}", "verifier_error") from None
    if len(diff) > MAX_DIFF_BYTES:
        raise Refused(f"the candidate's diff is over {MAX_DIFF_BYTES} bytes", "diff_too_large")
    return diff


async def clean_checkout_with(sandbox: SandboxHandle, original: HostRepo | ImageRepo,
                              commit: str, diff: bytes, patterns: list[str],
                              timeout: float) -> list[Change]:
    """Empty the workspace, unpack the original repository at `commit`, apply `diff`; the
    changes it made. Refused when it touches a protected path or links into one."""
    # u+rwX first: a folder the agent made unreadable would otherwise survive `rm -rf`.
    await _sh(sandbox, "chmod -R u+rwX . 2>/dev/null; find . -mindepth 1 -maxdepth 1 "
              "-exec rm -rf -- {} + && test -z \"$(ls -A)\"", timeout, "emptying the workspace")
    await original.put(sandbox, f"{GRADE_DIR}/repo.tar", timeout)
    await sandbox.write_file(f"{GRADE_DIR}/candidate.patch", diff)
    await _sh(sandbox, f"tar -xf {GRADE_DIR}/repo.tar --no-same-owner && rm {GRADE_DIR}/repo.tar",
              timeout, "unpacking the clean checkout")
    if diff.strip():
        res = await sandbox.exec(f"{GIT} apply --binary {GRADE_DIR}/candidate.patch",
                                 timeout=timeout)
        if not res.ok:
            raise Refused(f"the candidate's diff does not apply to a clean checkout: "
                          f"{res.stderr[-2000:]}", "patch_failed")
    # -f: a file the diff created is listed even where .gitignore would hide it.
    raw = await _sh(sandbox, f"rm -rf {GRADE_DIR} && {GIT} add -A -f && "
                    f"{GIT} diff --cached --raw -z --no-renames --abbrev=40 {commit}",
                    timeout, "listing the candidate's changes")
    changes = parse_raw(raw)
    protected = sorted(c.path for c in changes if is_protected(c.path, patterns))
    if protected:
        raise Refused("protected files changed: " + ", ".join(protected), "tests_modified")
    for c in changes:
        if c.new_mode == SYMLINK_MODE:
            target = await _sh(sandbox, f"{GIT} cat-file blob {c.new_sha}", 30, "reading a link")
            if link_refused(c.path, target, patterns):
                raise Refused(f"symlink {c.path} -> {target} points into a protected path or "
                              "out of the repository", "tests_modified")
    # Unstaged again, so the tests see the tree as a plain checkout plus the change.
    await _sh(sandbox, f"{GIT} reset -q", timeout, "unstaging")
    return changes
