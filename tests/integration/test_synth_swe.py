"""`kiln synth swe` on a repository the test builds: a fix with its test (one task, exact
F2P/P2P), a flaky test beside it (dropped), a commit whose new test already passes before the
change (no task), a docs-only commit (no candidate), a chore message (marked for drafting);
then the task set re-verifies with `kiln sandbox verify --null-fails` and a re-run is resumed."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kiln.services.sandbox.environments.tasks import load_taskset

from helpers.synth import CALC_V1, DIV_TEST, TESTS_V1, commit, git


# Passes on odd runs only, through a counter the runs share (what test pollution looks like).
FLAKY = '''

def test_flaky_counter():
    import pathlib
    p = pathlib.Path(".flaky-count")
    n = int(p.read_text()) if p.exists() else 0
    p.write_text(str(n + 1))
    assert n % 2 == 0
'''


@pytest.fixture(scope="module")
def history(tmp_path_factory) -> dict:
    repo = tmp_path_factory.mktemp("calc")
    git(repo, "init", "-q", "-b", "main")
    shas = {"init": commit(repo, "Initial calculator", {
        "calc/__init__.py": CALC_V1, "tests/test_calc.py": TESTS_V1,
        "pyproject.toml": '[project]\nname = "calc"\nversion = "0.1"\n'
                          'requires-python = ">=3.9"\ndependencies = []\n'})}
    shas["fix"] = commit(repo, "div() returns None when dividing by zero instead of raising "
                               "ZeroDivisionError", {
        "calc/__init__.py": CALC_V1.replace("        return None\n",
                                            "        raise ZeroDivisionError('b is zero')\n"),
        "tests/test_calc.py": TESTS_V1 + FLAKY + DIV_TEST})
    shas["docs"] = commit(repo, "Describe the project in a README file for new users",
                          {"README.md": "calc\n"})
    # A refactor with a new test that passes before the change too: no fail-to-pass test.
    shas["refactor"] = commit(repo, "Write clamp without nested calls to max and min", {
        "calc/__init__.py": (repo / "calc/__init__.py").read_text().replace(
            "    return max(lo, min(x, hi))", "    return lo if x < lo else hi if x > hi else x"),
        "tests/test_clamp.py": "import calc\n\n\ndef test_clamp():\n"
                               "    assert calc.clamp(5, 0, 3) == 3\n"})
    shas["chore"] = commit(repo, "fix", {
        "calc/__init__.py": (repo / "calc/__init__.py").read_text()
        + "\n\ndef neg(a):\n    return -a\n",
        "tests/test_neg.py": "import calc\n\n\ndef test_neg():\n    assert calc.neg(2) == -2\n"})
    return {"repo": repo, **shas}


def synth(repo: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kiln.cli.main", "synth", "swe", "--repo",
                           str(repo), "--out", str(out), *extra],
                          capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def synthesized(history, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("out")
    res = synth(history["repo"], out, "--rev-range", f"{history['init']}..main",
                "--max-tasks", "10")
    assert res.returncode == 0, res.stdout + res.stderr
    return {"out": out, "stdout": res.stdout,
            "tasks": [json.loads(line) for line in (out / "tasks.jsonl").read_text().splitlines()],
            "report": json.loads((out / "report.json").read_text())}


def test_fix_commit_yields_exact_f2p_and_p2p(history, synthesized):
    tasks = {t["meta"]["commit"]: t for t in synthesized["tasks"]}
    assert set(tasks) == {history["fix"], history["chore"]}
    task = tasks[history["fix"]]
    assert task["base_commit"] == history["init"]
    assert task["FAIL_TO_PASS"] == ["tests/test_calc.py::test_div_by_zero_raises"]
    assert task["PASS_TO_PASS"] == ["tests/test_calc.py::TestDiv::test_div",
                                    "tests/test_calc.py::test_add"]
    assert task["meta"]["flaky_tests"] == ["tests/test_calc.py::test_flaky_counter"]
    assert "raise ZeroDivisionError" in task["patch"] and "tests/" not in task["patch"]
    assert "test_div_by_zero_raises" in task["test_patch"] and "calc/__init__" not in task["test_patch"]
    assert task["problem_statement"].startswith("div() returns None")
    assert task["meta"]["statement_source"] == "commit"
    assert tasks[history["chore"]]["meta"]["statement_source"] == "needs-drafting"
    assert tasks[history["chore"]]["FAIL_TO_PASS"] == ["tests/test_neg.py::test_neg"]


def test_ids_run_with_plain_pytest(history, synthesized, tmp_path):
    """The ids are what `python -m pytest` takes, from the repository's root."""
    task = next(t for t in synthesized["tasks"] if t["meta"]["commit"] == history["fix"])
    work = tmp_path / "w"
    subprocess.run(["git", "clone", "-q", str(history["repo"]), str(work)], check=True)
    git(work, "checkout", "-q", history["fix"])
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          *task["FAIL_TO_PASS"], *task["PASS_TO_PASS"]], cwd=work,
                         capture_output=True, text=True)
    assert res.returncode == 0 and "3 passed" in res.stdout, res.stdout + res.stderr


def test_report_counts_and_reasons(history, synthesized):
    report = synthesized["report"]
    assert report["funnel"] == {"commits": 4, "candidates": 3, "environment": 3,
                                "F2P non-empty": 2, "stable": 2, "statement": 2,
                                "distinct": 2, "kept": 2}
    reasons = [json.loads(line) for line in
               (synthesized["out"] / "rejections.jsonl").read_text().splitlines()]
    assert reasons == [{"item": history["refactor"][:10], "step": "F2P non-empty",
                        "reason": "no test fails before the fix and passes after it"}]
    assert (synthesized["out"] / "funnel.png").stat().st_size > 0


def test_task_set_loads_and_reverifies(synthesized):
    out = synthesized["out"]
    tasks = load_taskset(out / "tasks.jsonl")
    assert [t.type for t in tasks] == ["swe", "swe"] and tasks[0].test_runner == "pytest"
    res = subprocess.run([sys.executable, "-m", "kiln.cli.main", "sandbox", "verify",
                          str(out / "tasks.jsonl"), "--solutions", str(out / "solutions"),
                          "--null-fails"], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "2/2 tasks pass" in res.stdout


def test_rerun_skips_decided_commits(history, synthesized):
    out = synthesized["out"]
    before = (out / "tasks.jsonl").read_text()
    res = synth(history["repo"], out, "--rev-range", f"{history['init']}..main",
                "--max-tasks", "10")
    assert res.returncode == 0, res.stderr
    assert (out / "tasks.jsonl").read_text() == before
    report = json.loads((out / "report.json").read_text())
    assert report["candidates_verified"] == 0 and report["funnel"]["kept"] == 2


def test_max_tasks_and_bad_range(history, tmp_path):
    res = synth(history["repo"], tmp_path / "one", "--max-tasks", "1")
    assert res.returncode == 0, res.stderr
    lines = (tmp_path / "one" / "tasks.jsonl").read_text().splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["meta"]["commit"] == history["chore"]
    res = synth(history["repo"], tmp_path / "bad", "--rev-range", "nosuch..main")
    assert res.returncode == 1 and "--rev-range nosuch..main" in res.stderr
