"""Run graded tests in a sandbox and read each one's outcome from the runner's own report.

`verifier_script.py` is written into the sandbox only for the run (into `.kiln-verifier/`,
removed after), run with `python3 -I` and asked for a JSON report of every test's outcome;
the report, not the exit code, is the verdict. A test the report does not name (an id that does
not exist, a module that fails to import, a process that died before writing the report) counts
as not passed. The report's name is random per run, so nothing the candidate wrote before the
run can stand in for it.

One process runs every id (unittest, pytest) or the one script (code tasks): a few hundred
PASS_TO_PASS tests cost one Python start-up, not hundreds.

Not covered: test runners other than unittest and pytest (SWE tasks name one of them).
"""
from __future__ import annotations

import json
import re
import secrets
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from kiln.env import SandboxHandle

VERIFIER_DIR = ".kiln-verifier"
SCRIPT = (Path(__file__).with_name("verifier_script.py")).read_text()
Runner = Literal["unittest", "pytest", "script"]


@dataclass
class TestRun:
    outcomes: dict[str, str] = field(default_factory=dict)
    exit_code: int = 0
    log: str = ""
    timed_out: bool = False
    reported: bool = False
    """Whether the runner wrote its report (False: it died or was stopped before the end)."""

    def passed(self, test: str) -> bool:
        return self.outcomes.get(test) == "passed"


def check_pythonpath(pythonpath: list[str]) -> None:
    for entry in pythonpath:
        if not re.fullmatch(r"[\w.][\w./-]*", entry) or ".." in entry.split("/"):
            raise ValueError(f"pythonpath: {entry!r} is not a plain folder inside the repository")


def verifier_command(runner: Runner, tests: list[str], pythonpath: list[str],
                     report: str) -> list[str]:
    check_pythonpath(pythonpath)
    return ["python3", "-I", f"{VERIFIER_DIR}/verifier_script.py", report, ".", runner,
            *pythonpath, "--", *tests]


async def run_tests(sandbox: SandboxHandle, runner: Runner, tests: list[str], *,
                    pythonpath: list[str] = (), timeout: float) -> TestRun:
    """Run `tests` with `runner` in the sandbox's workspace (the repository's root); the
    verifier's folder is removed afterwards, so the workspace is left as it was."""
    report = f"{VERIFIER_DIR}/report-{secrets.token_hex(8)}.json"
    await sandbox.exec(["rm", "-rf", VERIFIER_DIR], timeout=30)
    await sandbox.write_file(f"{VERIFIER_DIR}/verifier_script.py", SCRIPT.encode())
    try:
        res = await sandbox.exec(verifier_command(runner, tests, list(pythonpath), report),
                                 timeout=timeout)
        read = await sandbox.exec(["cat", report], timeout=30)
    finally:
        await sandbox.exec(["rm", "-rf", VERIFIER_DIR], timeout=30)
    outcomes, reported = {}, False
    if read.ok and not res.timed_out:
        try:
            parsed = json.loads(read.stdout)
        except json.JSONDecodeError:
            parsed = None
        if isinstance(parsed, dict) and parsed.get("complete") is True \
                and isinstance(parsed.get("outcomes"), dict):
            outcomes = {str(k): str(v) for k, v in parsed["outcomes"].items()}
            reported = True
    log = (res.stdout + res.stderr)[-6000:]
    if not reported:
        log += "\n[verifier: the test runner wrote no report; no test counts as passed]"
    return TestRun(outcomes, res.exit_code, log, res.timed_out, reported)


async def run_pytest(sandbox: SandboxHandle, tests: list[str], *, pythonpath: list[str],
                     timeout: float) -> TestRun:
    """`tests` (pytest ids, or files) in one pytest session."""
    return await run_tests(sandbox, "pytest", tests, pythonpath=pythonpath, timeout=timeout)


_COMMAND = re.compile(r"python3?\s+-m\s+(unittest|pytest)\s+\{test\}")


def runner_of_command(test_command: str) -> Runner:
    """The runner a SWE task's `test_command` names: `python3 -m unittest {test}` or
    `python3 -m pytest {test}`. Anything else is refused: a free shell command could only be
    judged by its exit code."""
    m = _COMMAND.fullmatch(" ".join(shlex.split(test_command)) if test_command else "")
    if m is None:
        raise ValueError(f"test_command: {test_command!r} is not one the verifier can read a "
                         "report from; expected 'python3 -m unittest {test}' or "
                         "'python3 -m pytest {test}' (or test_runner: pytest)")
    return m.group(1)  # type: ignore[return-value]
