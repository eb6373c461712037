"""Task sets from a Hugging Face Hub dataset (`spec.tasks[].source.hfDataset`): loaded by the
real `datasets` library from a local stand-in of the Hub (tests/helpers/fake_hub.py, reached
through HF_ENDPOINT; never the internet), written as the task file the sandbox's loader reads,
with the column mapping applied and a dataset that lacks a required column refused by name;
fetched once; a gated dataset only with its token; on a cluster an init container of the job's
image fetches it into the readers' folder; `kiln run` fetches it into the run directory, and a
refused pre-flight leaves nothing there.

The manifests are checked against Kubernetes' own schemas (`kubernetes_validate`); no API server
runs here.
"""
from __future__ import annotations

import argparse
import io
import json
import os
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from helpers.capabilities import checkpoint_config
from helpers.fake_hub import FakeHub, Repo
from helpers.operator_jobs import JOB, SMALL, spec, workload
from kiln.api.task_sources import TASKS_ROOT, TASKS_ROOT_ENV
from kiln.cli.exits import Exit
from kiln.cli.hf_tasks import DatasetError, fetch
from kiln.cli.devcluster.node import Node
from kiln.cli.local.preflight import prepare
from kiln.operator import children
from kiln.services.sandbox.episodes import load_task_set

TOKEN = "hf_test_token_0123456789"
REPO = Path(__file__).resolve().parents[2]
TERMINAL = [json.loads(line) for line in
            (REPO / "deploy" / "examples" / "tasks" / "terminal.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory):
    """Dataset repositories on the stand-in Hub: `org/terminal` names its task ids
    `instance_id` and carries a column no terminal task has; `org/bare` lacks the task fields."""
    root = tmp_path_factory.mktemp("hub")
    (root / "terminal" / "data").mkdir(parents=True)
    rows = [{**{k: v for k, v in t.items() if k != "id"}, "instance_id": t["id"],
             "source_url": "https://example.com"} for t in TERMINAL]
    (root / "terminal" / "data" / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "bare").mkdir()
    (root / "bare" / "train.jsonl").write_text(json.dumps({"instance_id": "a", "prompt": "x"}) + "\n")
    server = FakeHub({}, datasets={"org/terminal": Repo(root / "terminal"),
                                   "org/gated": Repo(root / "terminal", token=TOKEN),
                                   "org/bare": Repo(root / "bare")})
    url = server.start()
    yield server, url
    server.stop()


@pytest.fixture
def endpoint(hub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeHub:
    server, url = hub
    monkeypatch.setenv("HF_ENDPOINT", url)
    # huggingface_hub and datasets read HF_ENDPOINT once, when first imported; in a suite that
    # imported them before (transformers does), the loader would reach for the real Hub. A
    # fetch in its own process (the init container, `kiln fetch-tasks`) reads it at start.
    import datasets.config
    import huggingface_hub.constants as hub_constants
    monkeypatch.setattr(hub_constants, "ENDPOINT", url)
    monkeypatch.setattr(hub_constants, "HUGGINGFACE_CO_URL_TEMPLATE",
                        url + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(datasets.config, "HF_ENDPOINT", url)
    monkeypatch.setattr(datasets.config, "HUB_DATASETS_URL",
                        url + "/datasets/{repo_id}/resolve/{revision}/{path}")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    # kiln run's pre-flight names the task root for its services: restored after each test.
    monkeypatch.setenv(TASKS_ROOT_ENV, "unset")
    monkeypatch.delenv(TASKS_ROOT_ENV)
    return server


def _set(dataset: dict, name: str = "hub-set") -> dict:
    return {"name": name, "env": "terminal", "source": {"hfDataset": dataset}}


def _spec(*sets: dict):
    return spec(SMALL, tasks=list(sets),
                stages=[{"name": "sft", "type": "sft", "tasks": [s["name"] for s in sets]}])


def test_rows_become_task_records_the_sandbox_loads_once(endpoint: FakeHub, tmp_path: Path) -> None:
    ts = _spec(_set({"id": "org/terminal", "columns": {"id": "instance_id"}})).tasks[0]
    out = io.StringIO()
    file = fetch(ts, tmp_path / "tasks", out)
    assert file == tmp_path / "tasks" / "hub-set" / "tasks.jsonl"
    records = [json.loads(line) for line in file.read_text().splitlines()]
    assert records == TERMINAL  # mapped, and the column no terminal task has left out
    assert "columns left out (no field of a 'terminal' task): source_url" in out.getvalue()
    assert sorted(p.name for p in file.parent.iterdir()) == [".kiln-dataset.json", "tasks.jsonl"]
    # The sandbox reads it as a mounted source, under the task root.
    loaded = load_task_set(ts, Path.cwd(), str(tmp_path / "tasks"))
    assert [t.id for t in loaded.tasks] == ["count-words", "sort-unique"]
    fetched = list(endpoint.gets)
    fetch(ts, tmp_path / "tasks", io.StringIO())
    assert endpoint.gets == fetched  # recorded: nothing fetched again


def test_a_dataset_without_the_required_columns_is_refused_by_name(endpoint: FakeHub,
                                                                   tmp_path: Path) -> None:
    ts = _spec(_set({"id": "org/bare"})).tasks[0]
    with pytest.raises(DatasetError, match=r"spec.tasks\[hub-set\].source.hfDataset: dataset "
                       r"org/bare \(train\) has no column for the required field\(s\) description, "
                       r"id, test_script of a 'terminal' task") as err:
        fetch(ts, tmp_path, io.StringIO())
    assert not err.value.retry and not (tmp_path / "hub-set" / "tasks.jsonl").exists()
    mapped = _spec(_set({"id": "org/bare", "columns": {"id": "task_id"}})).tasks[0]
    with pytest.raises(DatasetError, match=r"\.columns: no such column in org/bare \(train\): "
                       r"id <- task_id; its columns: instance_id, prompt"):
        fetch(mapped, tmp_path, io.StringIO())


def test_a_gated_dataset_needs_the_token(endpoint: FakeHub, tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    ts = _spec(_set({"id": "org/gated", "columns": {"id": "instance_id"}})).tasks[0]
    with pytest.raises(DatasetError, match="not found, or not readable with the token given") as err:
        fetch(ts, tmp_path, io.StringIO())
    assert not err.value.retry
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    assert len(fetch(ts, tmp_path, io.StringIO()).read_text().splitlines()) == 2


def test_the_operator_fetches_a_dataset_in_an_init_container_with_its_token_only() -> None:
    data = {**SMALL, "tasks": [*SMALL["tasks"], _set({"id": "org/terminal",
                                                       "tokenSecret": "hf-read"})]}
    objs = children.desired_children(JOB, spec(data))
    for obj in objs:
        kubernetes_validate.validate(obj, "1.30.0", strict=True)
    pod = workload(objs, "sandbox")["spec"]["template"]["spec"]
    (fetcher,) = pod["initContainers"]
    assert fetcher["command"] == ["kiln", "fetch-tasks", "/etc/kiln/job.yaml",
                                  "--task-set", "hub-set", "--out", "/var/lib/kiln-tasks"]
    assert {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf-read", "key": "token"}}} \
        in fetcher["env"]
    assert {"name": "tasks-1", "mountPath": "/var/lib/kiln-tasks/hub-set"} in fetcher["volumeMounts"]
    assert {"name": "tasks-1", "emptyDir": {"sizeLimit": "1Gi"}} in pod["volumes"]
    (sandbox,) = pod["containers"]
    assert {"name": "tasks-1", "mountPath": f"{TASKS_ROOT}/hub-set", "readOnly": True} \
        in sandbox["volumeMounts"]
    # The token reaches the fetcher alone.
    for component in ("trainer", "rollout", "sandbox", "weight-sync", "buffer"):
        spec_ = workload(objs, component)["spec"]["template"]["spec"]
        for c in (*spec_.get("initContainers", []), *spec_["containers"]):
            if c is not fetcher:
                assert "hf-read" not in json.dumps(c), (component, c["name"])


@pytest.mark.slow  # a `kiln fetch-tasks` process: the datasets library's import alone takes seconds
def test_the_sandbox_pods_init_container_fetches_the_set_on_the_dev_cluster(
        endpoint: FakeHub, tmp_path: Path) -> None:
    """The operator's own sandbox pod, run by the development cluster's node agent: its init
    container (`kiln fetch-tasks`, the pod's HF_ENDPOINT reaching it) writes the task set where
    the sandbox container is told the task root is, and the loader reads it there."""
    data = {**SMALL, "tasks": [*SMALL["tasks"], _set({"id": "org/terminal",
                                                       "columns": {"id": "instance_id"}})],
            "sandbox": {"pod": {"env": [{"name": "HF_ENDPOINT", "value": os.environ["HF_ENDPOINT"]},
                                        {"name": "HF_HUB_DISABLE_TELEMETRY", "value": "1"}]}}}
    objs = children.desired_children(JOB, spec(data))
    sandbox = workload(objs, "sandbox")
    configmaps = {o["metadata"]["name"]: o for o in objs if o["kind"] == "ConfigMap"}
    node = Node(api=None, root=tmp_path / "node", workdir=tmp_path)
    pod = node._start_pod("team-a", "demo-sandbox-0", sandbox, sandbox["spec"]["template"], "h",
                          [], configmaps)
    (fetcher,) = pod.init
    assert fetcher.env["HF_ENDPOINT"] == os.environ["HF_ENDPOINT"] and "HF_TOKEN" not in fetcher.env
    node._spawn(fetcher)
    try:
        assert fetcher.proc.wait(120) == 0, fetcher.log_path.read_text()[-3000:]
    finally:
        if fetcher.proc.poll() is None:
            fetcher.proc.kill()
            fetcher.proc.wait()
    root = Path(pod.containers[0].env[TASKS_ROOT_ENV])
    loaded = load_task_set(spec(data).tasks[1], tmp_path, str(root))
    assert [t.id for t in loaded.tasks] == ["count-words", "sort-unique"]


def _job_file(tmp_path: Path, dataset: dict) -> Path:
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({
        "apiVersion": "kiln.dev/v1alpha1", "kind": "RLJob", "metadata": {"name": "hub"},
        "spec": {"model": {"path": str(checkpoint_config(tmp_path))}, "tasks": [_set(dataset)],
                 "stages": [{"name": "sft", "type": "sft", "tasks": ["hub-set"]}]}}))
    return job


def test_kiln_run_fetches_into_the_run_directory_and_a_refusal_leaves_nothing(
        endpoint: FakeHub, tmp_path: Path) -> None:
    run = tmp_path / "run"
    err = io.StringIO()
    code = prepare(argparse.Namespace(job=_job_file(tmp_path, {"id": "org/bare"}), run_dir=run,
                                      resume=None), io.StringIO(), err)
    assert code == Exit.REFUSED
    assert "spec.tasks[0].source.hfDataset: dataset org/bare" in err.getvalue()
    assert not run.exists()
    job = _job_file(tmp_path, {"id": "org/terminal", "columns": {"id": "instance_id"}})
    _, run_dir = prepare(argparse.Namespace(job=job, run_dir=run, resume=None),
                         io.StringIO(), io.StringIO())
    assert os.environ[TASKS_ROOT_ENV] == str(run_dir / "tasks")
    assert len((run_dir / "tasks" / "hub-set" / "tasks.jsonl").read_text().splitlines()) == 2
    # The saved job keeps the source as written (a resumed run finds the set recorded).
    assert "hfDataset" in (run_dir / "job.yaml").read_text()


def test_the_init_containers_command_writes_the_named_set(endpoint: FakeHub, tmp_path: Path,
                                                          capsys) -> None:
    from kiln.cli.main import main

    job = _job_file(tmp_path, {"id": "org/terminal", "columns": {"id": "instance_id"}})
    out = tmp_path / "tasks"
    assert main(["fetch-tasks", str(job), "--task-set", "other", "--out", str(out)]) == Exit.REFUSED
    assert "--task-set other: no task set of that name has an hfDataset source" in capsys.readouterr().err
    assert main(["fetch-tasks", str(job), "--task-set", "hub-set", "--out", str(out)]) == Exit.OK
    assert len((out / "hub-set" / "tasks.jsonl").read_text().splitlines()) == 2
