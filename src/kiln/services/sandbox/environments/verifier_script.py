"""The program that runs graded tests inside a sandbox and writes their outcomes as JSON.

It is copied into the sandbox and run there, with the sandbox's own Python, as

    python3 -I verifier_script.py REPORT ROOT RUNNER [PATH...] -- ID...

`-I` keeps the environment (PYTHON*), the user site and the current directory off the import
path, so a `difflib.py` or `sitecustomize.py` the candidate left at the repository root is never
imported in place of the standard library. The runner (unittest, pytest) is imported first;
only then are ROOT and the task's PATHs (relative to ROOT) put on `sys.path`, after the
standard library and before site-packages: the repository's own modules win over an installed
copy of themselves, never over the standard library.

Runners:
- `unittest`: each ID (a dotted test, class or module name) loaded and run; it passes when
  unittest's result is successful and at least one test ran unskipped;
- `pytest`: one session over every ID (`--import-mode=append`, so pytest puts no test folder
  in front of the standard library either); an ID passes when pytest's own reports of it say
  no phase failed and its call passed;
- `script`: the one ID is a Python file run as `__main__`; it passes when it runs to its end
  (an exception, `sys.exit` of any code or `os._exit` before the end is not a pass).

The verdict is this report, never the exit code: a process that exits early (`os._exit(0)` at
import) writes none, and every ID then counts as not passed. The report is written once, at the
end, with functions bound before any code under test was imported.

Not covered: code under test runs in this process and could, with deliberate effort, rewrite
the runner's objects in memory; the report stops exits, shadows and hijacks through files, not
a forger inside the interpreter. Standard library only: this file runs on any Python >= 3.8.
"""
import json
import os
import sys
import traceback


def _writer(path):
    dumps, fopen = json.dumps, open

    def write(outcomes):
        with fopen(path, "w") as f:
            f.write(dumps({"outcomes": outcomes, "complete": True}))
    return write


def _put_on_path(root, paths):
    entries = [root] + [os.path.join(root, p) for p in paths]
    site = [i for i, p in enumerate(sys.path) if p.endswith(("site-packages", "dist-packages"))]
    at = site[0] if site else len(sys.path)
    sys.path[at:at] = entries


def run_unittest(ids, root, paths):
    import unittest
    _put_on_path(root, paths)
    loader = unittest.TestLoader()
    runner = unittest.TextTestRunner(stream=sys.stderr, verbosity=1)
    outcomes = {}
    for test_id in ids:
        try:
            suite = loader.loadTestsFromName(test_id)
        except Exception:  # noqa: BLE001 (a test that cannot be loaded has not passed)
            traceback.print_exc()
            outcomes[test_id] = "error"
            continue
        result = runner.run(suite)
        ran = result.testsRun - len(result.skipped)
        outcomes[test_id] = "passed" if result.wasSuccessful() and ran > 0 else "failed"
    return outcomes


def run_pytest(ids, root, paths):
    import pytest
    phases = {}

    class Recorder:
        def pytest_runtest_logreport(self, report):
            phases.setdefault(report.nodeid, {})[report.when] = report.outcome

    _put_on_path(root, paths)
    # --continue-on-collection-errors: one module that cannot be imported must not hide every
    # other module's outcome; -p no:cacheprovider: nothing left in the repository.
    pytest.main(["-p", "no:cacheprovider", "--rootdir", root, "--import-mode=append",
                 "--continue-on-collection-errors", "-q", "-rf", *ids], plugins=[Recorder()])
    outcomes = {}
    for nodeid, seen in phases.items():
        if "failed" in seen.values():
            outcomes[nodeid] = "failed"
        elif seen.get("call") == "passed":
            outcomes[nodeid] = "passed"
        else:
            outcomes[nodeid] = "skipped"
    return outcomes


def run_script(ids, root, paths):
    import runpy
    _put_on_path(root, paths)
    (path,) = ids
    try:
        runpy.run_path(path, run_name="__main__")
    except BaseException:  # noqa: BLE001 (SystemExit too: a script that stops early failed)
        traceback.print_exc()
        return {path: "failed"}
    return {path: "passed"}


RUNNERS = {"unittest": run_unittest, "pytest": run_pytest, "script": run_script}


def main(argv):
    report, root, runner, rest = argv[0], os.path.abspath(argv[1]), argv[2], argv[3:]
    sep = rest.index("--")
    paths, ids = rest[:sep], rest[sep + 1:]
    write = _writer(os.path.abspath(report))
    os.chdir(root)
    write(RUNNERS[runner](ids, root, paths))


if __name__ == "__main__":
    main(sys.argv[1:])
