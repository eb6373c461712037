"""What `kiln synth swe` labels FAIL_TO_PASS, on a repository the test builds: a test that fails
at collection before its fix (it imports what the fix adds) and one whose fixture errors before
it count as failing there, so they are FAIL_TO_PASS; a test that fails on the first run before
the fix and passes on the second is flaky, and stays out of FAIL_TO_PASS and PASS_TO_PASS
although its first runs look like a fix. The tests run in bubblewrap sandboxes, twice per
state. The whole pipeline on a longer history: tests/integration/test_synth_swe.py."""
from __future__ import annotations

import json

import pytest

from helpers.synth import commit, git, kiln

CALC = "def add(a, b):\n    return a + b\n"
MUL = "\n\ndef mul(a, b):\n    return a * b\n"
POWER = "\n\ndef power(a, b):\n    return a ** b\n"
TESTS = '''\
import calc


def test_add():
    assert calc.add(2, 3) == 5
'''
COLLECTS_AFTER_MUL = "from calc import mul\n\n\ndef test_mul():\n    assert mul(2, 3) == 6\n"
POWER_TESTS = TESTS + '''

import pytest


@pytest.fixture
def cube():
    return calc.power(2, 3)  # AttributeError before the fix: an error in setup, not a failure


def test_cube(cube):
    assert cube == 8


def test_flaky_before_the_fix():
    # Fails on odd runs in one sandbox before the fix (a counter the runs share), and its
    # first run fails there: only the comparison of runs tells it from a fixed test.
    import pathlib
    if hasattr(calc, "power"):
        return
    p = pathlib.Path(".flaky-count")
    n = int(p.read_text()) if p.exists() else 0
    p.write_text(str(n + 1))
    assert n % 2 == 1
'''
PYPROJECT = '[project]\nname = "calc"\nversion = "0.1"\nrequires-python = ">=3.9"\ndependencies = []\n'


def _synth(repo, out, base) -> dict[str, dict]:
    res = kiln("synth", "swe", "--repo", str(repo), "--out", str(out), "--rev-range",
               f"{base}..main", "--runs", "2", "--jobs", "2")
    assert res.returncode == 0, res.stdout + res.stderr
    tasks = [json.loads(line) for line in (out / "tasks.jsonl").read_text().splitlines()]
    return {t["meta"]["commit"]: t for t in tasks}


def test_missing_and_erroring_tests_count_as_failing_and_flaky_ones_are_dropped(tmp_path):
    repo = tmp_path / "calc"
    repo.mkdir()
    git(repo, "init", "-q", "-b", "main")
    base = commit(repo, "Initial calculator", {
        "calc/__init__.py": CALC, "tests/test_calc.py": TESTS, "pyproject.toml": PYPROJECT})
    mul = commit(repo, "Multiplying two numbers is not possible: add calc.mul for products", {
        "calc/__init__.py": CALC + MUL, "tests/test_mul.py": COLLECTS_AFTER_MUL})
    power = commit(repo, "Raising a number to a power is not possible: add calc.power", {
        "calc/__init__.py": CALC + MUL + POWER, "tests/test_calc.py": POWER_TESTS})
    tasks = _synth(repo, tmp_path / "out", base)
    assert set(tasks) == {mul, power}
    # Not collected before the fix (its module fails to import): failing there.
    assert tasks[mul]["FAIL_TO_PASS"] == ["tests/test_mul.py::test_mul"]
    assert tasks[mul]["PASS_TO_PASS"] == [] and tasks[mul]["meta"]["flaky_tests"] == []
    # An error in setup before the fix: failing there. The flaky test: in neither list.
    assert tasks[power]["FAIL_TO_PASS"] == ["tests/test_calc.py::test_cube"]
    assert tasks[power]["PASS_TO_PASS"] == ["tests/test_calc.py::test_add"]
    assert tasks[power]["meta"]["flaky_tests"] == ["tests/test_calc.py::test_flaky_before_the_fix"]


def test_a_module_that_fails_collection_leaves_the_other_modules_outcomes(tmp_path):
    repo = tmp_path / "calc"
    repo.mkdir()
    git(repo, "init", "-q", "-b", "main")
    base = commit(repo, "Initial calculator", {
        "calc/__init__.py": CALC, "tests/test_calc.py": TESTS, "pyproject.toml": PYPROJECT})
    fix = commit(repo, "Multiplying two numbers is not possible: add calc.mul for products", {
        "calc/__init__.py": CALC + MUL, "tests/test_mul.py": COLLECTS_AFTER_MUL,
        "tests/test_calc.py": TESTS + "\n\ndef test_add_again():\n    assert calc.add(1, 1) == 2\n"})
    task = _synth(repo, tmp_path / "out", base)[fix]
    assert task["FAIL_TO_PASS"] == ["tests/test_mul.py::test_mul"]
