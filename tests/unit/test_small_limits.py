"""Small limits: `kiln export --out` keeps a folder with files in it unless told,
and a trainer of world size one listens on loopback only (no TCPStore on every interface)."""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kiln.cli import export


def _args(run: Path, out: Path, force: bool = False) -> argparse.Namespace:
    return argparse.Namespace(run_dir=run, out=out, step=None, stage=None, force=force, merge=False)


def test_export_refuses_a_folder_with_files_unless_forced(tmp_path, capsys) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert export.run(_args(tmp_path / "run", out)) == 1
    assert "not empty" in capsys.readouterr().err
    assert (out / "keep.txt").read_text() == "mine"
    (tmp_path / "file").write_text("x")
    assert export.run(_args(tmp_path / "run", tmp_path / "file")) == 1
    assert "not a folder" in capsys.readouterr().err
    # Forced, an empty folder or a new path: past the check (then refused: no run there).
    for target, force in ((out, True), (tmp_path / "empty", False), (tmp_path / "new", False)):
        if target.name == "empty":
            target.mkdir()
        assert export.run(_args(tmp_path / "run", target, force)) == 1
        assert "holds no job.yaml" in capsys.readouterr().err


def _listeners(pid: int) -> list[str]:
    """Local addresses of the TCP sockets `pid` listens on (hex from /proc/net/tcp*)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            cols = line.split()
            if cols[3] == "0A" and cols[9] in inodes:
                found.append(cols[1])
    return found


def test_a_world_of_one_listens_on_loopback_only() -> None:
    pytest.importorskip("megatron.core")
    script = textwrap.dedent("""
        import json, os, sys
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
        from kiln.models.parallel import init_parallel
        init_parallel(1)
        sys.stdout.write("ready\\n"); sys.stdout.flush()
        sys.stdin.read()
    """)
    from kiln.models.parallel import free_port
    proc = subprocess.Popen([sys.executable, "-c", script, str(free_port())], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        listening = _listeners(proc.pid)
    finally:
        proc.stdin.close()
        proc.wait(timeout=60)
    # 0100007F: 127.0.0.1; ...01000000: ::1. Anything else (0.0.0.0, ::) is every interface.
    loopback = [a for a in listening if a.split(":")[0] in ("0100007F", "0" * 24 + "01000000")]
    assert listening == loopback, listening


def test_git_clone_takes_the_spec_as_a_repository_never_an_option(tmp_path, monkeypatch) -> None:
    from kiln.cli.synth import gitmine
    marker = tmp_path / "PWNED"
    spec = f"--upload-pack=touch {marker}"
    with pytest.raises(gitmine.GitError, match="cannot clone"):
        gitmine.resolve_repo(spec, tmp_path / "cache")
    assert not marker.exists()
    seen = []
    monkeypatch.setattr(gitmine.subprocess, "run",
                        lambda argv, **kw: seen.append(argv) or subprocess.CompletedProcess(argv, 1, "", "x"))
    with pytest.raises(gitmine.GitError):
        gitmine.resolve_repo(spec, tmp_path / "cache")
    (argv,) = seen
    assert argv[argv.index("--") + 1] == spec
