"""Fast checks of the sandbox's pure parts: config parsing, paths, output caps, task files,
answer normalisation, BM25 ranking, the backend and environment factories."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kiln.services.sandbox.config import (BubblewrapConfig, DockerConfig, SandboxLimits,
                                          parse_config, parse_size)
from kiln.services.sandbox.environments.base import normalize_answer
from kiln.services.sandbox.environments.bm25 import BM25Index, Document
from kiln.services.sandbox.environments.tasks import (TaskSetError, load_taskset,
                                                      make_environment)
from kiln.services.sandbox.factory import make_sandbox
from kiln.services.sandbox.interface import PathEscapeError, workspace_relpath
from kiln.services.sandbox.output import CappedBuffer
from kiln.services.sandbox.workspace_fs import read_beneath, write_beneath

EXAMPLES = Path(__file__).resolve().parents[2] / "deploy" / "examples" / "tasks"


def test_parse_size_units_and_errors():
    assert parse_size("512m") == 512 << 20
    assert parse_size("2Gi") == 2 << 30
    assert parse_size("1048576") == 1 << 20
    assert parse_size(4096) == 4096
    with pytest.raises(ValueError, match="memory"):
        parse_size("lots", "memory")
    with pytest.raises(ValueError):
        parse_size(0)


def test_config_discriminates_and_rejects_unknown_backend():
    assert isinstance(parse_config({"type": "bubblewrap"}), BubblewrapConfig)
    cfg = parse_config({"type": "docker", "limits": {"memory_bytes": "1g"}})
    assert isinstance(cfg, DockerConfig) and cfg.limits.memory_bytes == 1 << 30
    with pytest.raises(ValueError, match="type"):
        parse_config({"type": "gvisor"})
    with pytest.raises(ValueError, match="type"):
        make_sandbox(SandboxLimits())  # not a backend config at all
    with pytest.raises(ValueError, match="owner"):
        BubblewrapConfig(owner="Bad Owner!")
    with pytest.raises(ValueError, match="pids"):
        SandboxLimits(pids=1)


def test_workspace_relpath_rejects_escapes():
    assert workspace_relpath("a/b.txt") == "a/b.txt"
    assert workspace_relpath("/workspace/a/../b") == "b"
    for bad in ("../x", "/etc/passwd", "/workspace/../etc/passwd", "a/../../x", "", ".",
                "/workspace", "/workspacex/y"):
        with pytest.raises(PathEscapeError):
            workspace_relpath(bad)


def test_capped_buffer_keeps_prefix_and_marks_cut():
    buf = CappedBuffer(10)
    for _ in range(5):
        buf.feed(b"0123456789")
    text = buf.text()
    assert text.startswith("0123456789")
    assert buf.truncated and buf.dropped == 40
    assert "truncated, 40 more bytes dropped" in text
    small = CappedBuffer(100)
    small.feed(b"hello")
    assert small.text() == "hello" and not small.truncated


def test_host_side_file_access_refuses_symlinks(tmp_path):
    root = tmp_path / "ws"
    root.mkdir()
    outside = tmp_path / "secret"
    outside.write_text("top secret")
    os.symlink(outside, root / "link")
    os.symlink(tmp_path, root / "dirlink")
    uid, gid = os.getuid(), os.getgid()
    write_beneath(root, "sub/dir/f.txt", b"data", 0o600, uid, gid)
    assert read_beneath(root, "sub/dir/f.txt") == b"data"
    assert read_beneath(root, "sub/dir/f.txt", max_bytes=2) == b"da"
    for path in ("link", "dirlink/secret", "../secret"):
        with pytest.raises(PathEscapeError):
            read_beneath(root, path)
    with pytest.raises(PathEscapeError):
        write_beneath(root, "link", b"x", 0o644, uid, gid)
    with pytest.raises(PathEscapeError):
        write_beneath(root, "dirlink/new", b"x", 0o644, uid, gid)
    assert outside.read_text() == "top secret"
    assert not (tmp_path / "new").exists()
    with pytest.raises(FileNotFoundError):
        read_beneath(root, "missing.txt")


def test_normalize_answer():
    assert normalize_answer("The  Eiffel-Tower.") == "eiffel tower"
    assert normalize_answer("338350.0") == normalize_answer("338350")
    assert normalize_answer("3.50") == "3.5"
    assert normalize_answer("Seln") != normalize_answer("Wiss")


def test_bm25_ranks_the_matching_document_first():
    docs = [Document("a", "Keldor", "The river Seln flows through Keldor."),
            Document("b", "Seln", "The Seln joins Lake Amber."),
            Document("c", "Glass", "Glassworks and a spring fair in the valley.")]
    index = BM25Index(docs)
    assert index.search("lake amber")[0].id == "b"
    assert index.search("glassworks fair")[0].id == "c"
    assert index.search("zeppelin") == []
    assert "Lake Amber" in index.open("b")
    with pytest.raises(KeyError, match="doc_id"):
        index.open("zzz")


def test_example_corpus_search_finds_the_evidence():
    index = BM25Index.from_folder(EXAMPLES / "corpora" / "geo")
    assert index.search("observatory founded by Ilse Marrow")[0].id in ("varna.html",
                                                                       "marrow.txt")
    hit = index.search("which river flows through Keldor")[0]
    assert hit.id == "keldor.md"
    # HTML is reduced to text: the script body is not indexed, the title is.
    assert "var x" not in index.open("varna.html")
    assert index.docs["varna.html"].title == "Varna Observatory"


def test_example_tasksets_load():
    for name, count in (("terminal", 2), ("swe", 1), ("search", 2), ("code", 3)):
        tasks = load_taskset(EXAMPLES / f"{name}.jsonl")
        assert len(tasks) == count and all(t.type == name for t in tasks)


def _write(tmp_path, records) -> Path:
    path = tmp_path / "tasks.jsonl"
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in records))
    return path


def test_taskset_errors_name_task_and_field(tmp_path):
    good = {"id": "t1", "type": "terminal", "description": "d", "test_script": "true"}
    missing = {"id": "t2", "type": "terminal", "description": "d"}
    with pytest.raises(TaskSetError, match=r"tasks.jsonl:2, task 't2': field 'test_script'"):
        load_taskset(_write(tmp_path, [good, missing]))
    wrong = {"id": "s1", "type": "swe", "repo": "r", "commit": "c", "problem_statement": "p",
             "fail_to_pass": "not-a-list"}
    with pytest.raises(TaskSetError, match=r"task 's1': field 'fail_to_pass'"):
        load_taskset(_write(tmp_path, [wrong]))
    with pytest.raises(TaskSetError, match=r"task 'x': field 'type'"):
        load_taskset(_write(tmp_path, [{"id": "x", "type": "chess"}]))
    with pytest.raises(TaskSetError, match="not valid JSON"):
        load_taskset(_write(tmp_path, ["{oops"]))
    with pytest.raises(TaskSetError, match="field 'id': duplicate"):
        load_taskset(_write(tmp_path, [good, good]))
    with pytest.raises(TaskSetError, match="field 'bogus'"):
        load_taskset(_write(tmp_path, [{**good, "bogus": 1}]))
    with pytest.raises(ValueError, match="type"):
        make_environment("chess")


def test_the_manifests_sizes_are_read_as_kubernetes_quantities() -> None:
    from kiln.api.components import SandboxSpec
    from kiln.services.sandbox.config import config_from_spec

    config = config_from_spec(SandboxSpec(memory="500M", disk="1Gi"), "owner")
    assert config.limits.memory_bytes == 500 * 10**6  # not 500 MiB
    assert config.limits.disk_bytes == 1 << 30
