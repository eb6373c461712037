"""The pure parts of `kiln synth swe`: project detection, test-path rules, statement checks,
and SWE-bench field names read by the swe task model."""
from __future__ import annotations

import json

import pytest

from kiln.cli.synth import gitmine, pyenv
from kiln.cli.synth.swe import leaks_patch, statement_describes
from kiln.services.sandbox.environments.verifier import verifier_command
from kiln.services.sandbox.environments.tasks import TaskSetError, parse_task


def detect(files: dict[str, str]) -> pyenv.PythonProject:
    return pyenv.detect(files.get, list(files))


def test_detect_reads_every_declaration():
    project = detect({
        "pyproject.toml": '[project]\nname = "x"\nrequires-python = ">=3.10"\n'
                          'dependencies = ["attrs>=22", "tomli; python_version < \'3.11\'"]\n',
        "setup.cfg": "[options]\ninstall_requires =\n    six\n",
        "setup.py": "from setuptools import setup\nsetup(install_requires=['idna==3.4'])\n",
        "requirements.txt": "# pinned\nrequests==2.31 ; python_version >= '3.8'\n-r dev.txt\n",
        "src/x/__init__.py": ""})
    assert project.pythonpath == ["src"]
    assert project.requires_python == ">=3.10"
    # tomli's marker excludes Python 3.11, the sandbox's; -r includes are not followed.
    assert project.dependencies == ["attrs", "idna", "requests", "six"]
    assert project.sources == ["pyproject.toml", "setup.cfg", "setup.py", "requirements.txt"]
    assert detect({"x/__init__.py": ""}).pythonpath == []


def test_cache_key_follows_dependencies_only():
    a = detect({"pyproject.toml": '[project]\ndependencies = ["six"]\n'})
    b = detect({"pyproject.toml": '[project]\nname = "renamed"\ndependencies = ["six"]\n'})
    c = detect({"pyproject.toml": '[project]\ndependencies = ["six", "attrs"]\n'})
    assert a.key() == b.key() != c.key()


def test_bad_pyproject_names_the_file():
    with pytest.raises(ValueError, match="pyproject.toml: not valid TOML"):
        detect({"pyproject.toml": "[project\n"})


def test_verdicts():
    project = pyenv.PythonProject(requires_python=">=3.12", dependencies=["six"])
    probe = {"python": "3.11.2", "missing": [], "pytest": "7.2.1"}
    assert "excludes the sandbox's python 3.11.2" in pyenv.verdict(project, probe)
    project.requires_python = ">=3.9"
    assert pyenv.verdict(project, probe) is None
    assert pyenv.verdict(project, {**probe, "missing": ["six"]}) == \
        "environment: dependencies missing offline: six"
    assert "no pytest" in pyenv.verdict(project, {**probe, "pytest": None})


@pytest.mark.parametrize("path,test", [
    ("tests/test_a.py", True), ("pkg/tests/data/x.json", True), ("test_b.py", True),
    ("pkg/b_test.py", True), ("conftest.py", True), ("pkg/testing.py", False),
    ("pkg/contest.py", False), ("src/pkg/core.py", False)])
def test_test_paths(path, test):
    assert gitmine.is_test_path(path) is test


def test_statement_rules():
    assert statement_describes("Raise a clear ValueError for negative n in chunked()")
    assert statement_describes("Issue 1214: Update __eq__ and __hash__ for numeric_range")
    assert not statement_describes("fix")
    assert not statement_describes("Fix #123")
    assert not statement_describes("Run the formatter on every module of the package")
    assert not statement_describes("Bump version to 10.2.0 for the release of today")
    patch = "--- a/x.py\n+++ b/x.py\n+    raise ValueError('n must be at least 0')\n+ x\n"
    assert leaks_patch("It should do raise ValueError('n must be at least 0') here", patch)
    assert not leaks_patch("chunked() accepts a negative n silently", patch)


def test_verifier_command_refuses_odd_paths():
    cmd = verifier_command("pytest", ["t.py::a"], ["src"], "r")
    assert cmd[:2] == ["python3", "-I"] and cmd[-3:] == ["src", "--", "t.py::a"]
    with pytest.raises(ValueError, match="pythonpath"):
        verifier_command("pytest", ["t.py"], ["../etc"], "r")
    with pytest.raises(ValueError, match="pythonpath"):
        verifier_command("pytest", ["t.py"], ["$(reboot)"], "r")


def test_swe_bench_names_load():
    record = {"instance_id": "a-1", "type": "swe", "repo": "repos/a.bundle", "base_commit": "abc",
              "patch": "diff", "FAIL_TO_PASS": json.dumps(["t.py::x"]), "PASS_TO_PASS": "[]",
              "problem_statement": "p", "version": "1.0", "test_runner": "pytest"}
    task = parse_task(record)
    assert (task.id, task.commit, task.gold_patch, task.fail_to_pass, task.pass_to_pass) == \
        ("a-1", "abc", "diff", ["t.py::x"], [])
    assert task.meta == {"version": "1.0"}
    with pytest.raises(TaskSetError, match="FAIL_TO_PASS"):
        parse_task({**record, "FAIL_TO_PASS": "not json"})
    with pytest.raises(TaskSetError, match="disagree"):
        parse_task({**record, "commit": "other"})
