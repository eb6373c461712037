"""SWE tasks: a git repository at a commit, a problem statement, fail-to-pass and pass-to-pass
tests. Reward 1 only if every F2P test passes and every P2P test still passes.

TaskSet record:

    {"id": "calc-div", "type": "swe",
     "repo": "repos/calc.bundle",        # a git repo folder or `git bundle`, relative to the file
     "commit": "4b1c...",                # the state the agent starts from
     "problem_statement": "divide() crashes on ...",
     "fail_to_pass": ["tests.test_calc.DivTest.test_zero"],
     "pass_to_pass": ["tests.test_calc.AddTest.test_add"],
     "test_command": "python3 -m unittest {test}",   # the runner: unittest or pytest
     "test_files": ["tests/**"]}          # optional; protected files besides the defaults

SWE-bench's field names are read too (`instance_id`, `base_commit`, `patch`, `FAIL_TO_PASS`,
`PASS_TO_PASS`, lists or JSON strings), so `kiln synth swe` output and imported SWE-bench-style
files load as they are; SWE-bench's `repo` ("owner/name") goes in `repo_name` and `repo` is the
local repository. With `"test_runner": "pytest"` ids are as `python -m pytest` takes them;
`pythonpath` folders go on the import path after the standard library.

The repository is checked out on the host and copied into /workspace (with its .git). A task
that names its own `image` (the SWE-bench convention: one image per instance, the repository
and its dependencies inside, at `repo_path`, /testbed by default) gives no `repo`: the docker
backend runs it in that image, and the repository is copied from `repo_path` into /workspace.
That folder must be a clean checkout of `commit` and must not be writable by the sandbox user:
grading reads the original repository from there, so nothing the agent does may change it
(both checked at set-up, which refuses the task otherwise). The bubblewrap backend refuses a
task that names an image (`factory.config_for`).

Tools: `bash`, `view` (a file with line numbers, or a folder's listing), `str_replace` (replace
one exact, unique occurrence of a string in a file), `create` (a new file), `submit`. The tests
that grade (FAIL_TO_PASS, PASS_TO_PASS) run only after the episode; a `test_patch` (the tests
the fix must make pass, SWE-bench style) is applied only then, so the agent never sees it.

Grading (`swe_grading.py`), the SWE-bench way: the candidate's diff against the commit is
taken with a trusted git folder, applied onto a fresh checkout in an emptied workspace, and
refused (reward 0, flag `tests_modified`) when it changes a protected file (tests,
conftest.py, modules that could hijack the runner: sitecustomize.py, unittest/pytest shadows,
.pth files, ini files) or adds a symlink into one. The tests then run in one `python3 -I`
process (`verifier.py`): `test_command` names the runner (`python3 -m unittest {test}` or
`python3 -m pytest {test}`; any other command is refused at load), and each test's outcome is
read from the runner's own report, never from an exit code.
Reference solution: `{id}.patch`, applied with `git apply`; `gold_patch` in the record (optional)
is the demonstration SFT imitates.

Not covered: building the per-instance images (build them with the repository and its
dependencies, as SWE-bench's harness does); test runners other than unittest and pytest.
"""
from __future__ import annotations

import asyncio
import json
import posixpath
import shlex
from typing import Literal

from pydantic import Field, model_validator

from kiln.env import AssistantTurn, Grade, SandboxHandle, ToolCall, ToolResult, ToolSpec, string_tool
from .base import BASH, SUBMIT, TOOL_OUTPUT_CHARS, Environment, Task, kill_leftovers, truncate, unknown_tool
from .swe_grading import (GIT, HostRepo, ImageRepo, Refused, candidate_diff, checkout_tar,
                          clean_checkout_with)
from .verifier import check_pythonpath, run_tests, runner_of_command

VIEW = ToolSpec("view", "Show a file with line numbers (optionally lines start..end), or list a "
                "folder.", {"type": "object", "properties": {
                    "path": {"type": "string", "description": "path relative to the repository"},
                    "start": {"type": "integer", "description": "first line (1-based)"},
                    "end": {"type": "integer", "description": "last line"}},
                    "required": ["path"]})
STR_REPLACE = string_tool("str_replace", "Replace the one occurrence of `old` in a file by `new`.",
                          path="path relative to the repository", old="exact text to replace "
                          "(must occur exactly once)", new="replacement text")
CREATE = string_tool("create", "Create a new file.", path="path relative to the repository",
                     content="the file's content")
TOOLS = [BASH, VIEW, STR_REPLACE, CREATE, SUBMIT]

DEFAULT_PROTECTED = [
    "tests/*", "test/*", "*/tests/*", "*/test/*", "test_*.py", "*/test_*.py", "*_test.py",
    "conftest.py", "*/conftest.py", "sitecustomize.py", "*/sitecustomize.py",
    "usercustomize.py", "*/usercustomize.py", "unittest.py", "unittest/*", "pytest.py",
    "pytest/*", "_pytest/*", "*.pth", "*/*.pth", "pytest.ini", "tox.ini", "setup.cfg",
    "pyproject.toml",
]


class SweTask(Task):
    type: Literal["swe"] = "swe"
    repo: str = ""
    """A git folder or `git bundle` on the service's host, relative to the task file; empty
    for a task whose `image` holds the repository."""
    repo_path: str = "/testbed"
    """With `image`: the repository's folder inside the image (SWE-bench's images: /testbed)."""
    commit: str = Field(min_length=1)
    problem_statement: str = Field(min_length=1)
    fail_to_pass: list[str] = Field(min_length=1)
    pass_to_pass: list[str] = Field(default_factory=list)
    test_command: str = "python3 -m unittest {test}"
    test_files: list[str] = Field(default_factory=list)
    test_patch: str = ""
    """A diff adding the tests that grade; applied only after the episode."""
    gold_patch: str = ""
    """The reference fix (a diff), for demonstrations."""
    command_timeout_seconds: float = Field(60.0, gt=0)
    """Wall-clock limit of one `bash` call of the agent."""
    test_runner: Literal["command", "pytest"] = "command"
    """`command`: the runner `test_command` names; `pytest`: pytest."""
    pythonpath: list[str] = Field(default_factory=list)
    """Folders (relative to the repository) put on the tests' import path."""
    repo_name: str = ""
    """Where the repository came from (SWE-bench's `repo`, e.g. "owner/name")."""
    environment: dict = Field(default_factory=dict)
    """How the repository's tests were found to run (`kiln synth swe` records it)."""
    created_at: str = ""
    hints_text: str = ""
    meta: dict = Field(default_factory=dict)
    """Provenance a producer keeps beside the task (source commit, statement source...)."""

    @model_validator(mode="before")
    @classmethod
    def _swe_bench_names(cls, data):
        if not isinstance(data, dict):
            return data
        data = dict(data)
        for theirs, ours in (("instance_id", "id"), ("base_commit", "commit"),
                             ("patch", "gold_patch"), ("FAIL_TO_PASS", "fail_to_pass"),
                             ("PASS_TO_PASS", "pass_to_pass")):
            if theirs in data:
                value = data.pop(theirs)
                if ours in data and data[ours] != value:
                    raise ValueError(f"fields {theirs!r} and {ours!r} disagree")
                if ours.endswith("_pass") and isinstance(value, str):
                    try:  # SWE-bench's published files store these lists as JSON strings
                        value = json.loads(value)
                    except json.JSONDecodeError:
                        raise ValueError(f"field {theirs!r}: expected a list of test ids or a "
                                         "JSON string of one") from None
                data[ours] = value
        for extra in ("version", "environment_setup_commit"):
            if extra in data:
                data.setdefault("meta", {})
                data["meta"] = {**data["meta"], extra: data.pop(extra)}
        return data

    @model_validator(mode="after")
    def _repository(self) -> "SweTask":
        if self.image and self.repo:
            raise ValueError("repo and image: give the repository one way, `repo` (a git folder "
                             "or bundle on the host) or `image` (holding it at repo_path); a "
                             "SWE-bench `repo` (owner/name) goes in repo_name")
        if not self.image and not self.repo:
            raise ValueError("repo: required (a git folder or bundle, relative to the task "
                             "file), unless the task's image holds the repository")
        path = posixpath.normpath(self.repo_path)
        if not self.repo_path.startswith("/") or path == "/" or ".." in self.repo_path.split("/"):
            raise ValueError(f"repo_path: {self.repo_path!r} must be an absolute folder of the "
                             "image, not / and without '..'")
        return self

    @model_validator(mode="after")
    def _gradable(self) -> "SweTask":
        if self.test_runner == "command":
            runner_of_command(self.test_command)
        check_pythonpath(self.pythonpath)
        return self


class SweEnvironment(Environment):
    type = "swe"
    task_model = SweTask
    solution_name = "{id}.patch"

    def system_prompt(self, task: SweTask) -> str:
        return ("You are fixing an issue in the repository in /workspace. Explore it, edit the "
                "code with the tools, then call submit.")

    def user_prompt(self, task: SweTask) -> str:
        return task.problem_statement

    def tools(self, task: SweTask) -> list[ToolSpec]:
        return TOOLS

    async def call_tool(self, sandbox: SandboxHandle, task: SweTask, call: ToolCall) -> ToolResult:
        args = call.arguments
        if call.name == "bash":
            return await self.run_bash(sandbox, call, task.command_timeout_seconds)
        if call.name == "submit":
            return ToolResult("submitted", done=True)
        if call.name not in ("view", "str_replace", "create"):
            return unknown_tool(call, TOOLS)
        path = args.get("path")
        if not isinstance(path, str) or not path:
            return ToolResult(f"error: {call.name} needs a string argument `path`")
        if call.name == "view":
            return await self._view(sandbox, path, args.get("start"), args.get("end"))
        if call.name == "create":
            content = args.get("content")
            if not isinstance(content, str):
                return ToolResult("error: create needs a string argument `content`")
            try:
                await sandbox.read_file(path, 1)
                return ToolResult(f"error: {path} exists; edit it with str_replace")
            except FileNotFoundError:
                pass
            except (ValueError, OSError) as exc:
                return ToolResult(f"error: {exc}")
            await sandbox.write_file(path, content.encode())
            return ToolResult(f"created {path}")
        old, new = args.get("old"), args.get("new")
        if not isinstance(old, str) or not isinstance(new, str) or not old:
            return ToolResult("error: str_replace needs string arguments `old` (non-empty) and `new`")
        try:
            text = (await sandbox.read_file(path)).decode("utf-8")
        except (FileNotFoundError, ValueError, OSError, UnicodeDecodeError) as exc:
            return ToolResult(f"error: cannot read {path}: {exc}")
        count = text.count(old)
        if count != 1:
            return ToolResult(f"error: `old` occurs {count} times in {path}; it must occur once")
        await sandbox.write_file(path, text.replace(old, new).encode())
        return ToolResult(f"edited {path}")

    async def _view(self, sandbox: SandboxHandle, path: str, start, end) -> ToolResult:
        try:
            data = await sandbox.read_file(path)
        except IsADirectoryError:
            data = None
        except FileNotFoundError:
            return ToolResult(f"error: {path} does not exist")
        except ValueError as exc:  # not a regular file: perhaps a folder
            data = None
            if "not a regular file" not in str(exc):
                return ToolResult(f"error: {exc}")
        if data is None:
            res = await sandbox.exec(["ls", "-la", path], timeout=10)
            return ToolResult(truncate(res.stdout or res.stderr, TOOL_OUTPUT_CHARS))
        lines = data.decode("utf-8", "replace").splitlines()
        lo = max(1, int(start)) if isinstance(start, int) else 1
        hi = min(len(lines), int(end)) if isinstance(end, int) else len(lines)
        shown = "\n".join(f"{i:6d}  {lines[i - 1]}" for i in range(lo, hi + 1))
        return ToolResult(truncate(shown, TOOL_OUTPUT_CHARS))

    def demonstrate(self, task: SweTask, rng) -> list[AssistantTurn] | None:
        if not task.gold_patch:
            return None
        write = ToolCall("create", {"path": ".kiln-fix.patch", "content": task.gold_patch})
        apply = ToolCall("bash", {"command": "git apply .kiln-fix.patch && rm .kiln-fix.patch"})
        return [AssistantTurn(tool_calls=[write]), AssistantTurn(tool_calls=[apply]),
                AssistantTurn(tool_calls=[ToolCall("submit", {})])]

    def _patterns(self, task: SweTask) -> list[str]:
        return DEFAULT_PROTECTED + list(task.test_files)

    def _original(self, task: SweTask) -> HostRepo | ImageRepo:
        if task.image:
            return ImageRepo(task.repo_path)
        return HostRepo(self.resolve(task.repo), task.commit)

    async def setup(self, sandbox: SandboxHandle, task: SweTask) -> None:
        if task.image:
            await self._setup_from_image(sandbox, task)
            return
        tar = await asyncio.to_thread(checkout_tar, self.resolve(task.repo), task.commit)
        await sandbox.write_file(".kiln-repo.tar", tar)
        res = await sandbox.exec("tar -xf .kiln-repo.tar --no-same-owner && rm .kiln-repo.tar",
                                 timeout=task.timeout_seconds)
        if not res.ok:
            raise RuntimeError(f"task {task.id}: unpacking the repo failed: {res.stderr[-2000:]}")

    async def _setup_from_image(self, sandbox: SandboxHandle, task: SweTask) -> None:
        """Copy the image's repository into the workspace, after checking that it is the
        original grading may rely on: not writable by the sandbox user, a clean checkout of
        the task's commit."""
        where = f"task {task.id}: {task.repo_path} in image {task.image}"
        path = shlex.quote(task.repo_path)
        res = await sandbox.exec(f"test -d {path} && find {path} -writable -print -quit",
                                 timeout=task.timeout_seconds)
        if not res.ok:
            raise RuntimeError(f"{where}: no such folder (repo_path): {res.stderr[-500:]}")
        if res.stdout.strip():
            raise RuntimeError(f"{where} is writable by the sandbox user "
                               f"({res.stdout.strip()}): grading reads the original repository "
                               "from there, so the agent must not be able to change it; make "
                               "it owned by root and not writable by others in the image")
        res = await sandbox.exec(f"tar -cf - -C {path} . | tar -xf - --no-same-owner && "
                                 f"{GIT} rev-parse HEAD && "
                                 f"{GIT} rev-parse --verify -q {shlex.quote(task.commit)}^{{commit}} && "
                                 f"{GIT} status --porcelain", timeout=task.timeout_seconds)
        lines = res.stdout.splitlines()
        if not res.ok or len(lines) < 2:
            raise RuntimeError(f"{where}: copying it, or finding commit {task.commit} in it, "
                               f"failed: {res.stderr[-2000:]}")
        if lines[0] != lines[1]:
            raise RuntimeError(f"{where}: its HEAD is {lines[0]}, not the task's commit "
                               f"{task.commit}")
        if lines[2:]:
            raise RuntimeError(f"{where}: not a clean checkout of {task.commit} (git status: "
                               f"{'; '.join(lines[2:7])}): the agent's diff is taken against "
                               "the commit")

    def runner(self, task: SweTask) -> str:
        return "pytest" if task.test_runner == "pytest" else runner_of_command(task.test_command)

    async def grade(self, sandbox: SandboxHandle, task: SweTask, answer: str | None = None
                    ) -> Grade:
        await kill_leftovers(sandbox)
        original, patterns = self._original(task), self._patterns(task)
        try:
            diff = await candidate_diff(sandbox, original, task.commit, task.timeout_seconds)
            await clean_checkout_with(sandbox, original, task.commit, diff, patterns,
                                      task.timeout_seconds)
        except Refused as exc:
            return Grade(0.0, parts={"f2p": 0.0, "p2p": 0.0}, output=str(exc)[-8000:],
                         flags=[exc.flag])
        if task.test_patch:
            await sandbox.write_file(".kiln-tests.patch", task.test_patch.encode())
            res = await sandbox.exec("git apply .kiln-tests.patch; rc=$?; rm -f .kiln-tests.patch; "
                                     "exit $rc", timeout=60)
            if not res.ok:
                return Grade(0.0, parts={"f2p": 0.0, "p2p": 0.0}, flags=["verifier_error"],
                             output=f"the test patch does not apply: {res.stderr[-2000:]}")
        tests = list(dict.fromkeys(task.fail_to_pass + task.pass_to_pass))
        run = await run_tests(sandbox, self.runner(task), tests, pythonpath=task.pythonpath,
                              timeout=task.timeout_seconds)
        f2p = sum(map(run.passed, task.fail_to_pass)) / len(task.fail_to_pass)
        p2p = (sum(map(run.passed, task.pass_to_pass)) / len(task.pass_to_pass)
               if task.pass_to_pass else 1.0)
        failing = [t for t in tests if not run.passed(t)]
        output = (f"not passed: {' '.join(failing[:50])}\n" if failing else "") + run.log
        flags = ["verifier_timeout"] if run.timed_out else []
        reward = 1.0 if f2p == 1.0 and p2p == 1.0 else 0.0
        return Grade(reward, parts={"f2p": f2p, "p2p": p2p}, output=output[-8000:], flags=flags)

    async def apply_solution(self, sandbox: SandboxHandle, task: SweTask, solution: bytes
                             ) -> str | None:
        await sandbox.write_file(".kiln-solution.patch", solution)
        res = await sandbox.exec("git apply .kiln-solution.patch; rc=$?; "
                                 "rm -f .kiln-solution.patch; exit $rc", timeout=60)
        if not res.ok:
            raise RuntimeError(f"task {task.id}: reference patch does not apply: {res.stderr}")
        return None
