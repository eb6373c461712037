"""`kiln synth import swe-bench|terminal-bench`: records re-verified in real sandboxes (the
reference passes, doing nothing fails) before they are written; the written sets load and
pass `kiln sandbox verify`."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from kiln.services.sandbox.environments.tasks import load_taskset

from helpers.synth import CALC_V1, DIV_TEST, TESTS_V1, commit, git, kiln


def diff(repo: Path) -> str:
    return subprocess.run(["git", "-C", str(repo), "diff"], check=True, capture_output=True,
                          text=True).stdout


@pytest.fixture(scope="module")
def swe_bench_file(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("swebench")
    repo = root / "repos" / "acme__calc"
    repo.mkdir(parents=True)
    git(repo, "init", "-q", "-b", "main")
    base = commit(repo, "init", {"calc/__init__.py": CALC_V1, "tests/test_calc.py": TESTS_V1})
    fixed = CALC_V1.replace("        return None\n", "        raise ZeroDivisionError\n")
    (repo / "calc/__init__.py").write_text(fixed)
    patch = diff(repo)
    git(repo, "checkout", "-q", "--", ".")
    (repo / "tests/test_calc.py").write_text(TESTS_V1 + DIV_TEST)
    test_patch = diff(repo)
    git(repo, "checkout", "-q", "--", ".")
    good = {"instance_id": "acme__calc-1", "repo": "acme/calc", "base_commit": base,
            "patch": patch, "test_patch": test_patch, "problem_statement": "div(1, 0) returns None",
            "FAIL_TO_PASS": json.dumps(["tests/test_calc.py::test_div_by_zero_raises"]),
            "PASS_TO_PASS": json.dumps(["tests/test_calc.py::test_add",
                                        "tests/test_calc.py::TestDiv::test_div"]),
            "version": "0.1"}
    wrong_gold = {**good, "instance_id": "acme__calc-2",  # applies, fixes nothing
                  "patch": patch.replace("raise ZeroDivisionError", "return 0")}
    no_repo = {**good, "instance_id": "other__x-1", "repo": "other/x"}
    broken = {"instance_id": "acme__calc-3", "repo": "acme/calc"}
    path = root / "instances.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in (good, wrong_gold, no_repo, broken)))
    return {"file": path, "repos": root / "repos"}


def test_swe_bench_import(swe_bench_file, tmp_path):
    out = tmp_path / "out"
    res = kiln("synth", "import", "swe-bench", str(swe_bench_file["file"]), "--repos",
               str(swe_bench_file["repos"]), "--out", str(out))
    assert res.returncode == 0, res.stdout + res.stderr
    report = json.loads((out / "report.json").read_text())
    assert report["funnel"] == {"records": 4, "well-formed": 3, "environment": 2,
                                "reference passes": 1, "null fails": 1, "kept": 1}
    reasons = {r["item"]: (r["step"], r["reason"]) for r in
               map(json.loads, (out / "rejections.jsonl").read_text().splitlines())}
    assert reasons["acme__calc-3"] == ("well-formed", "missing field(s) base_commit, patch, "
                                       "FAIL_TO_PASS, problem_statement")
    assert reasons["other__x-1"][0] == "environment" and "other/x" in reasons["other__x-1"][1]
    assert reasons["acme__calc-2"][0] == "reference passes"
    [task] = load_taskset(out / "tasks.jsonl")
    assert task.id == "acme__calc-1" and task.repo_name == "acme/calc"
    assert task.fail_to_pass == ["tests/test_calc.py::test_div_by_zero_raises"]
    assert task.meta == {"version": "0.1"}
    res = kiln("sandbox", "verify", str(out / "tasks.jsonl"), "--solutions",
               str(out / "solutions"), "--null-fails")
    assert res.returncode == 0 and "1/1 tasks pass" in res.stdout, res.stdout + res.stderr


def _tb_task(root: Path, name: str, test_body: str, solution: str) -> None:
    folder = root / name
    (folder / "tests").mkdir(parents=True)
    (folder / "data").mkdir()
    (folder / "data" / "numbers.txt").write_text("3\n1\n2\n")
    (folder / "task.yaml").write_text(
        "instruction: |\n  Sort /app/numbers.txt numerically into /app/sorted.txt.\n"
        "difficulty: easy\nmax_test_timeout_sec: 60\n")
    (folder / "Dockerfile").write_text(
        "FROM ghcr.io/laude-institute/t-bench/ubuntu-24-04:20250624\nWORKDIR /app\n"
        "COPY data/numbers.txt /app/numbers.txt\nRUN mkdir -p /app/out\n")
    (folder / "run-tests.sh").write_text(
        "#!/bin/bash\napt-get update\ncurl -LsSf https://astral.sh/uv/install.sh | sh\n"
        "source $HOME/.local/bin/env\nuv run pytest $TEST_DIR/test_outputs.py -rA\n")
    (folder / "tests" / "test_outputs.py").write_text(test_body)
    (folder / "solution.sh").write_text(solution)


def test_terminal_bench_import(tmp_path):
    src = tmp_path / "tb"
    _tb_task(src, "sort-numbers",
             "from pathlib import Path\n\n\ndef test_sorted():\n"
             "    assert Path('/app/sorted.txt').read_text() == '1\\n2\\n3\\n'\n"
             "    assert Path('/app/out').is_dir()\n",
             "#!/bin/bash\nsort -n /app/numbers.txt > /app/sorted.txt\n")
    _tb_task(src, "always-passes", "def test_nothing():\n    assert True\n", "true\n")
    (src / "no-yaml").mkdir()
    out = tmp_path / "out"
    res = kiln("synth", "import", "terminal-bench", str(src), "--out", str(out))
    assert res.returncode == 0, res.stdout + res.stderr
    report = json.loads((out / "report.json").read_text())
    assert report["funnel"]["records"] == 2 and report["funnel"]["kept"] == 1
    assert report["rejected_by_reason"] == {"null fails: passes with no solution applied": 1}
    [task] = load_taskset(out / "tasks.jsonl")
    assert task.id == "sort-numbers" and task.files == {"numbers.txt": "3\n1\n2\n"}
    assert "apt-get" not in task.test_script and "python3 -m pytest" in task.test_script
    res = kiln("sandbox", "verify", str(out / "tasks.jsonl"), "--solutions",
               str(out / "solutions"), "--null-fails")
    assert res.returncode == 0 and "1/1 tasks pass" in res.stdout, res.stdout + res.stderr
    # A re-run keeps what is written and verifies nothing again.
    res = kiln("synth", "import", "terminal-bench", str(src), "--out", str(out))
    assert res.returncode == 0 and len((out / "tasks.jsonl").read_text().splitlines()) == 1


def test_import_missing_source(tmp_path):
    res = kiln("synth", "import", "terminal-bench", str(tmp_path / "nope"), "--out",
               str(tmp_path / "o"))
    assert res.returncode == 1 and "nope does not exist" in res.stderr
