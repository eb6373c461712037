"""A tiny Python project built commit by commit for the task-synthesis tests, and the `kiln`
command they run on it."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path


CALC_V1 = '''\
def add(a, b):
    return a + b


def div(a, b):
    if b == 0:
        return None
    return a / b


def clamp(x, lo, hi):
    return max(lo, min(x, hi))
'''


TESTS_V1 = '''\
import calc


def test_add():
    assert calc.add(2, 3) == 5
'''


DIV_TEST = '''

def test_div_by_zero_raises():
    import pytest
    with pytest.raises(ZeroDivisionError):
        calc.div(1, 0)


class TestDiv:
    def test_div(self):
        assert calc.div(6, 3) == 2
'''


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True,
                          text=True).stdout.strip()


def commit(repo: Path, message: str, files: dict[str, str]) -> str:
    for path, text in files.items():
        (repo / path).parent.mkdir(parents=True, exist_ok=True)
        (repo / path).write_text(text)
    git(repo, "add", "-A")
    git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", message)
    return git(repo, "rev-parse", "HEAD")


# IMPORTS: import subprocess; import sys
def kiln(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kiln.cli.main", *args], capture_output=True,
                          text=True, timeout=600)
