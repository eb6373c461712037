"""Run many pytest ids in one process in a sandbox and read each one's outcome.

One process per test (`test_command` with `{test}`) costs a Python start-up and a collection per
test: a few hundred PASS_TO_PASS tests take minutes. Here one `python3 -m pytest` run takes all
the ids, and a small plugin, written into the sandbox only for the run, records every test's
phases and writes `{nodeid: "passed" | "failed" | "skipped"}` as JSON when the session ends
(after the code under test has run, so nothing it wrote earlier survives). A test that pytest
never reported (an id that does not exist, a file that fails to import) is absent, and callers
count it as not passed. The results file has a random name in the plugin's folder (each command
gets a fresh /tmp, so it cannot live there), and the folder is removed after the run.

Not covered: other runners (unittest ids go through pytest, which runs unittest classes).
"""
from __future__ import annotations

import json
import re
import secrets
import shlex
from dataclasses import dataclass, field

from kiln.env import SandboxHandle

PLUGIN_DIR = ".kiln-verifier"
PLUGIN_MODULE = "kiln_pytest_outcomes"
PLUGIN = '''\
import json, os

_phases = {}


def pytest_runtest_logreport(report):
    _phases.setdefault(report.nodeid, {})[report.when] = report.outcome


def pytest_sessionfinish(session, exitstatus):
    out = {}
    for nodeid, phases in _phases.items():
        if "failed" in phases.values():
            out[nodeid] = "failed"
        elif phases.get("call") == "passed":
            out[nodeid] = "passed"
        else:
            out[nodeid] = "skipped"
    with open(os.path.join(os.environ["KILN_PYTEST_ROOT"], os.environ["KILN_PYTEST_OUTCOMES"]),
              "w") as f:
        json.dump(out, f)
'''


@dataclass
class PytestRun:
    outcomes: dict[str, str] = field(default_factory=dict)
    exit_code: int = 0
    log: str = ""
    timed_out: bool = False

    def passed(self, test: str) -> bool:
        return self.outcomes.get(test) == "passed"


def pytest_command(tests: list[str], pythonpath: list[str], results: str) -> str:
    for entry in pythonpath:
        if not re.fullmatch(r"[\w.][\w./-]*", entry) or ".." in entry.split("/"):
            raise ValueError(f"pythonpath: {entry!r} is not a plain folder inside the repository")
    # Absolute entries: a test that changes directory still imports the project.
    path = ":".join(f"$PWD/{p}" for p in [*pythonpath, PLUGIN_DIR])
    ids = " ".join(shlex.quote(t) for t in tests)
    # -p no:cacheprovider: no .pytest_cache left in the repository; -q -rf: a short log whose
    # tail names what failed.
    # --rootdir=.: node ids relative to the repository's root, whatever ini file pytest finds.
    # --continue-on-collection-errors: one module that cannot be imported must not hide every
    # other module's outcome (pytest stops the session otherwise; their tests would all count
    # as not passed, and a task synthesised from that run mislabelled).
    return (f"PYTHONPATH=\"{path}\" KILN_PYTEST_OUTCOMES={shlex.quote(results)} "
            f"KILN_PYTEST_ROOT=\"$PWD\" python3 -m pytest -p {PLUGIN_MODULE} -p no:cacheprovider "
            f"--rootdir=. --continue-on-collection-errors -q -rf {ids}")


async def run_pytest(sandbox: SandboxHandle, tests: list[str], *, pythonpath: list[str],
                     timeout: float) -> PytestRun:
    """Run `tests` (pytest ids, or files) in the sandbox's workspace; the plugin folder is
    removed again afterwards so the repository is left as it was."""
    results = f"{PLUGIN_DIR}/outcomes-{secrets.token_hex(8)}.json"
    await sandbox.write_file(f"{PLUGIN_DIR}/{PLUGIN_MODULE}.py", PLUGIN.encode())
    try:
        res = await sandbox.exec(pytest_command(tests, pythonpath, results), timeout=timeout)
        read = await sandbox.exec(["cat", results], timeout=30)
    finally:
        await sandbox.exec(["rm", "-rf", PLUGIN_DIR], timeout=30)
    outcomes: dict[str, str] = {}
    if read.ok:
        try:
            parsed = json.loads(read.stdout)
            if isinstance(parsed, dict):
                outcomes = {str(k): str(v) for k, v in parsed.items()}
        except json.JSONDecodeError:
            pass  # the session died before it wrote the file; every test counts as not passed
    return PytestRun(outcomes, res.exit_code, (res.stdout + res.stderr)[-6000:], res.timed_out)
