"""Models by Hub id (`spec.model.hub`): downloaded through the real huggingface_hub client from a
local stand-in of the Hub (tests/helpers/fake_hub.py, reached through HF_ENDPOINT; never the
internet): only the files a checkpoint needs, resumed after a stop, checked against the Hub's
checksums, recorded so that it happens once, and a gated repository only with its token."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from helpers.fake_hub import FakeHub, Repo
from kiln.api.model import HubModel
from kiln.cli.local.hub import RECORD, HubError, download

TOKEN = "hf_test_token_0123456789"


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    folder = tmp_path / "hub" / "tiny"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForCausalLM"]}))
    (folder / "model-00001-of-00002.safetensors").write_bytes(bytes(range(256)) * 600)
    (folder / "model-00002-of-00002.safetensors").write_bytes(b"\x07" * 70_000)
    (folder / "tokenizer.json").write_text('{"version": "1.0"}')
    (folder / "pytorch_model.bin").write_bytes(b"pickled weights are never fetched")
    (folder / "README.md").write_text("# a model card")
    return folder


@pytest.fixture
def hub(repo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    server = FakeHub({"org/tiny": Repo(repo), "org/gated": Repo(repo, token=TOKEN)})
    monkeypatch.setenv("HF_ENDPOINT", server.start())
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    yield server
    server.stop()


def test_downloads_the_checkpoint_files_once(hub: FakeHub, tmp_path: Path, capsys,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    dest = tmp_path / "models" / "tiny"
    commit = download(HubModel(id="org/tiny"), dest)
    got = sorted(p.name for p in dest.iterdir() if not p.name.startswith("."))
    assert got == ["config.json", "model-00001-of-00002.safetensors",
                   "model-00002-of-00002.safetensors", "tokenizer.json"]
    assert (dest / "model-00001-of-00002.safetensors").read_bytes() == bytes(range(256)) * 600
    record = json.loads((dest / RECORD).read_text())
    assert (record["id"], record["revision"], record["commit"]) == ("org/tiny", "main", commit)
    assert "checksums verified" in capsys.readouterr().out
    fetched = list(hub.gets)
    assert download(HubModel(id="org/tiny"), dest) == commit
    assert download(HubModel(id="org/tiny", revision=commit), dest) == commit
    assert hub.gets == fetched  # recorded: nothing fetched again
    # The record alone answers: a pod restarted while the Hub is unreachable still starts.
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    assert download(HubModel(id="org/tiny"), dest) == commit


def test_a_stopped_download_resumes_without_fetching_finished_files(hub: FakeHub,
                                                                  tmp_path: Path) -> None:
    dest, big = tmp_path / "m", "model-00001-of-00002.safetensors"
    hub.drop[big] = 1000  # the connection keeps dropping: the client gives up
    with pytest.raises(HubError, match="run again to resume") as err:
        download(HubModel(id="org/tiny"), dest)
    assert err.value.retry and not (dest / RECORD).exists()
    assert (dest / "config.json").exists()  # half a download: not taken for a checkpoint
    hub.drop.clear()
    before = len(hub.gets)
    download(HubModel(id="org/tiny"), dest)  # run again (a restarted init container)
    again = [g.split(" ")[0] for g in hub.gets[before:]]
    assert again == [big]  # the files that arrived complete are not fetched again
    assert (dest / RECORD).exists()


def test_a_dropped_connection_is_resumed(hub: FakeHub, tmp_path: Path) -> None:
    hub.drop["model-00002-of-00002.safetensors"] = 1
    download(HubModel(id="org/tiny"), tmp_path / "m")
    assert (tmp_path / "m" / "model-00002-of-00002.safetensors").read_bytes() == b"\x07" * 70_000


def test_a_file_that_differs_from_the_hubs_checksum_is_deleted_and_named(hub: FakeHub,
                                                                       tmp_path: Path) -> None:
    name = "model-00002-of-00002.safetensors"
    hub.corrupt[name] = b"\x08" * 70_000  # same size, other bytes
    with pytest.raises(HubError, match=f"{name}: size or checksum differs") as err:
        download(HubModel(id="org/tiny"), tmp_path / "m")
    assert err.value.retry and not (tmp_path / "m" / name).exists()
    assert not (tmp_path / "m" / RECORD).exists()


def test_a_gated_repository_needs_the_token(hub: FakeHub, tmp_path: Path, monkeypatch,
                                            capsys) -> None:
    with pytest.raises(HubError, match="gated or private.*HF_TOKEN") as err:
        download(HubModel(id="org/gated"), tmp_path / "m")
    assert not err.value.retry
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    download(HubModel(id="org/gated"), tmp_path / "m")
    out = capsys.readouterr()
    assert TOKEN not in out.out + out.err


def test_what_cannot_work_is_refused_by_name(hub: FakeHub, repo: Path, tmp_path: Path) -> None:
    with pytest.raises(HubError, match="spec.model.hub.revision: 'v9'") as err:
        download(HubModel(id="org/tiny", revision="v9"), tmp_path / "a")
    assert not err.value.retry
    with pytest.raises(HubError, match="spec.model.hub.id: no repository 'org/nothing'"):
        download(HubModel(id="org/nothing"), tmp_path / "b")
    for f in repo.glob("*.safetensors"):
        f.unlink()
    with pytest.raises(HubError, match="holds no \\*.safetensors weights"):
        download(HubModel(id="org/tiny"), tmp_path / "c")


def test_prepare_model_downloads_the_jobs_model(hub: FakeHub, tmp_path: Path) -> None:
    job = {"apiVersion": "kiln.dev/v1alpha1", "kind": "RLJob", "metadata": {"name": "hub"},
           "spec": {"model": {"path": str(tmp_path / "models" / "tiny"), "hub": {"id": "org/tiny"}},
                    "tasks": [{"name": "t", "env": "chain", "generate": {"count": 4}}],
                    "stages": [{"name": "sft", "type": "sft", "tasks": ["t"]}]}}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    run = subprocess.run([sys.executable, "-m", "kiln.cli.main", "validate", str(path)],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert f"will download org/tiny@main from {hub_url(hub)}" in run.stdout
    run = subprocess.run([sys.executable, "-m", "kiln.cli.main", "prepare-model", str(path)],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert (tmp_path / "models" / "tiny" / RECORD).exists()
    job["spec"]["model"]["hub"]["id"] = "org/gated"  # no token here: refused, not retried
    job["spec"]["model"]["path"] = str(tmp_path / "models" / "gated")
    path.write_text(yaml.safe_dump(job))
    run = subprocess.run([sys.executable, "-m", "kiln.cli.main", "prepare-model", str(path)],
                         capture_output=True, text=True)
    assert run.returncode == 1 and "gated or private" in run.stderr, run.stderr


def hub_url(hub: FakeHub) -> str:
    host, port = hub.server.server_address[:2]
    return f"http://{host}:{port}"


def test_a_pod_finds_the_model_under_the_model_volume(monkeypatch: pytest.MonkeyPatch) -> None:
    from kiln.api.model import ModelSpec

    on_pvc = ModelSpec(path="qwen3-8b", pvc="models", tokenizer="tok")
    local = ModelSpec(path="models/qwen3-8b")
    monkeypatch.delenv("KILN_MODEL_ROOT", raising=False)
    assert on_pvc.local_path() == Path("qwen3-8b")
    monkeypatch.setenv("KILN_MODEL_ROOT", "/models")  # what the operator sets in its pods
    assert on_pvc.local_path() == Path("/models/qwen3-8b")
    assert on_pvc.tokenizer_path() == Path("/models/tok")
    assert local.local_path() == Path("models/qwen3-8b")  # no volume: where it says
    assert ModelSpec(path="/abs/m", pvc="models").local_path() == Path("/abs/m")
