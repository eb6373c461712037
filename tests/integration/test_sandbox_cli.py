"""`kiln sandbox exec|verify` as a user runs them: real processes, exit codes, messages."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[2] / "deploy" / "examples" / "tasks"


def kiln(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kiln.cli.sandbox", "sandbox", *args],
                          capture_output=True, text=True, timeout=timeout)


def test_exec_passes_exit_code_and_output():
    r = kiln("exec", "--", "sh", "-c", "echo out; echo err >&2; exit 3")
    assert r.returncode == 3 and r.stdout == "out\n" and r.stderr == "err\n"


def test_exec_timeout_exits_124_with_explanation():
    r = kiln("exec", "--timeout", "1", "--", "sleep", "30")
    assert r.returncode == 124
    assert r.stderr.strip().splitlines()[-1] == \
        "kiln sandbox: killed after the 1 s timeout (exit 124)"


def test_exec_oom_exits_137_with_explanation():
    r = kiln("exec", "--memory", "48Mi", "--", "python3", "-c", "b = bytearray(400 << 20)")
    assert r.returncode == 137
    assert "OOM killer at the 48Mi memory limit (exit 137)" in r.stderr


def test_exec_output_capped_with_marker():
    r = kiln("exec", "--output-limit", "1000", "--", "seq", "1", "100000")
    assert r.returncode == 0
    assert len(r.stdout) < 1100
    assert "[kiln-sandbox: output truncated," in r.stdout


def test_exec_workdir_and_network_flags():
    r = kiln("exec", "--workdir", "sub", "--", "pwd")
    # The workdir must exist; a missing one is an error from bubblewrap, not a silent cd.
    assert r.returncode != 0
    r = kiln("exec", "--network", "--", "sh", "-c", "cat /proc/net/dev | wc -l")
    assert r.returncode == 0 and int(r.stdout) > 3  # more than loopback: the host's devices


def test_verify_reports_each_task():
    r = kiln("verify", str(EXAMPLES / "terminal.jsonl"), "--solutions", str(EXAMPLES / "solutions"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "PASS count-words reward=1" in r.stdout and "PASS sort-unique reward=1" in r.stdout
    r = kiln("verify", str(EXAMPLES / "terminal.jsonl"), "--solutions", str(EXAMPLES))
    assert r.returncode == 3
    assert "FAIL count-words no reference solution" in r.stdout


def test_exec_disk_caps_the_workspace():
    r = kiln("exec", "--disk", "4Mi", "--", "sh", "-c",
             "dd if=/dev/zero of=f bs=1M count=16 2>&1; df -k . | tail -1")
    assert r.returncode == 0
    assert "No space left on device" in r.stdout, r.stdout
    size_kb = int(r.stdout.strip().splitlines()[-1].split()[1])
    assert 3000 <= size_kb <= 4096, r.stdout
    r = kiln("exec", "--disk", "lots", "--", "true")
    assert r.returncode == 1 and "argument --disk: 'lots' is not a Kubernetes quantity" in r.stderr
