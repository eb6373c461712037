"""Task sets a cluster keeps (`spec.tasks[].source`, `kiln.api.task_sources`): the spec takes
exactly one source and refuses a bad one by field; the operator mounts a ConfigMap key or a PVC
read-only into the containers that read task files (the sandbox, and the `prepare-model` init
container of a model that is made) and nowhere else; the development cluster's node agent turns
those mounts into folders a pod's processes read; the sandbox's loader reads the task set from
there; `kiln run` refuses a cluster-only source by field and writes nothing.

The manifests are checked against Kubernetes' own schemas (`kubernetes_validate`); the node
agent is driven without an API server (none can run here), everything else is real.
"""
from __future__ import annotations

import argparse
import copy
import io
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from kiln.api.task_sources import TASKS_ROOT, TASKS_ROOT_ENV
from kiln.api.validate import validate_text
from kiln.cli.devcluster.node import Node
from kiln.cli.local.preflight import prepare
from kiln.operator import children
from kiln.services.sandbox.episodes import EpisodeError, load_task_set

from helpers.operator_jobs import JOB, SMALL, spec, workload

REPO = Path(__file__).resolve().parents[2]
TERMINAL = (REPO / "deploy" / "examples" / "tasks" / "terminal.jsonl").read_text()
CM = {"configMap": {"name": "team-tasks", "key": "terminal.jsonl"}}
PVC = {"pvc": {"claim": "datasets", "path": "sets/terminal.jsonl"}}
IMAGE = {"image": {"ref": "registry.example.com/team/tasks:1", "path": "terminal.jsonl"}}


def _sourced(**changes) -> dict:
    data = copy.deepcopy(SMALL)
    data["tasks"] += [{"name": "cm-set", "env": "terminal", "source": CM},
                      {"name": "pvc-set", "env": "terminal", "source": PVC},
                      {"name": "image-set", "env": "terminal", "source": IMAGE}]
    data.update(changes)
    return data


def _job_text(task: dict) -> str:
    return yaml.safe_dump({"apiVersion": "kiln.dev/v1alpha1", "kind": "RLJob",
                           "metadata": {"name": "j"}, "spec": {**SMALL, "tasks": [task]}})


@pytest.mark.parametrize("task, field, message", [
    ({"source": {**CM, **PVC}}, "spec.tasks[0].source", "exactly one of path, configMap, pvc, image or hfDataset"),
    ({"source": {}}, "spec.tasks[0].source", "exactly one of path, configMap, pvc, image or hfDataset"),
    ({"source": {"configMap": {"name": "team-tasks"}}}, "spec.tasks[0].source.configMap.key",
     "required"),
    ({"source": {"configMap": {"name": "Team_Tasks", "key": "t.jsonl"}}},
     "spec.tasks[0].source.configMap.name", "pattern"),
    # A file outside the claim it names is refused before anything mounts it.
    ({"source": {"pvc": {"claim": "datasets", "path": "../etc/passwd"}}},
     "spec.tasks[0].source.pvc", "relative to the volume's root, without '..'"),
    ({"source": {"pvc": {"claim": "datasets", "path": "/etc/passwd"}}},
     "spec.tasks[0].source.pvc", "relative to the volume's root"),
    ({"source": {"image": {"ref": "r/tasks:1", "path": "../x.jsonl"}}},
     "spec.tasks[0].source.image", "relative to the image's /tasks folder, without '..'"),
    ({"source": CM, "generate": {"count": 4}}, "spec.tasks[0]",
     "exactly one of path, source or generate must be set (found source, generate)"),
], ids=["two-sources", "no-source", "no-key", "bad-name", "dotdot", "absolute", "image-dotdot",
        "and-generate"])
def test_a_bad_source_is_refused_by_field(task: dict, field: str, message: str) -> None:
    _, problems = validate_text(_job_text({"name": "train", "env": "chain", **task}), file="j.yaml")
    assert any(p.path == field and message in p.message for p in problems), problems


def test_source_path_is_the_simple_case_spelled_long() -> None:
    ts = spec(SMALL, tasks=[{"name": "train", "env": "terminal",
                             "source": {"path": "tasks/t.jsonl"}}]).tasks[0]
    assert ts.path == "tasks/t.jsonl" and ts.source is None


def test_the_operator_mounts_each_source_read_only_into_its_readers_only() -> None:
    data = _sourced(model={"path": "models/tiny", "init": {"hiddenSize": 32, "numLayers": 1,
                                                           "numHeads": 2, "numKvHeads": 1,
                                                           "intermediateSize": 64}})
    objs = children.desired_children(JOB, spec(data))
    for obj in objs:
        kubernetes_validate.validate(obj, "1.30.0", strict=True)
    expected_volumes = [
        {"name": "tasks-1", "configMap": {"name": "team-tasks",
                                          "items": [{"key": "terminal.jsonl", "path": "terminal.jsonl"}]}},
        {"name": "tasks-2", "persistentVolumeClaim": {"claimName": "datasets", "readOnly": True}},
        {"name": "tasks-3", "emptyDir": {"sizeLimit": "1Gi"}}]
    expected_mounts = [
        {"name": "tasks-1", "mountPath": f"{TASKS_ROOT}/cm-set", "readOnly": True},
        {"name": "tasks-2", "mountPath": f"{TASKS_ROOT}/pvc-set", "readOnly": True},
        {"name": "tasks-3", "mountPath": f"{TASKS_ROOT}/image-set", "readOnly": True}]
    readers = 0
    for component in ("trainer", "rollout", "sandbox", "weight-sync", "buffer"):
        pod = workload(objs, component)["spec"]["template"]["spec"]
        for c in (*pod.get("initContainers", []), *pod["containers"]):
            mounts = [m for m in c.get("volumeMounts", []) if m["name"].startswith("tasks-")]
            env = {e["name"]: e.get("value") for e in c.get("env", [])}
            if c["name"] in ("sandbox", "prepare-model"):
                readers += 1
                assert mounts == expected_mounts, (component, c["name"])
                assert env[TASKS_ROOT_ENV] == TASKS_ROOT
            elif c["name"] != "tasks-3":  # the image's copier, below
                assert not mounts and TASKS_ROOT_ENV not in env, (component, c["name"])
        has = [v for v in pod["volumes"] if v["name"].startswith("tasks-")]
        assert has == (expected_volumes if component in ("trainer", "rollout", "sandbox") else [])
        if component in ("trainer", "rollout", "sandbox"):
            # The image's /tasks is copied first, before any reader (prepare-model) starts.
            copier = pod["initContainers"][0]
            assert copier["image"] == "registry.example.com/team/tasks:1"
            assert copier["command"] == ["cp", "-R", "/tasks/.", "/var/lib/kiln-tasks"]
            assert copier["volumeMounts"] == [{"name": "tasks-3", "mountPath": "/var/lib/kiln-tasks"}]
            assert copier["securityContext"]["runAsNonRoot"] is True
    assert readers == 3  # the sandbox service and the two prepare-model init containers


def test_no_source_no_mount() -> None:
    pod = workload(children.desired_children(JOB, spec(SMALL)), "sandbox")["spec"]["template"]["spec"]
    assert not [v for v in pod["volumes"] if v["name"].startswith("tasks-")]
    assert TASKS_ROOT_ENV not in {e["name"] for e in pod["containers"][0]["env"]}


def test_the_dev_cluster_pod_reads_a_configmap_sourced_task_set(tmp_path: Path) -> None:
    """The operator's own sandbox pod template, run by the node agent: the task root the
    container is told is a folder holding the user's ConfigMap key, which the sandbox's loader
    reads as the task set."""
    data = _sourced()
    data["tasks"] = data["tasks"][:2]  # the ConfigMap one
    sandbox = workload(children.desired_children(JOB, spec(data)), "sandbox")
    configmaps = {"demo-config": {"data": {"job.yaml": "kind: RLJob\n"}},
                  "team-tasks": {"data": {"terminal.jsonl": TERMINAL, "other.jsonl": "{}\n"}}}
    node = Node(api=None, root=tmp_path, workdir=tmp_path)
    pod = node._start_pod("team-a", "demo-sandbox-0", sandbox, sandbox["spec"]["template"], "h",
                          [], configmaps)
    (c,) = pod.containers
    root = Path(c.env[TASKS_ROOT_ENV])
    assert root.is_dir() and str(root).startswith(str(tmp_path))
    # Only the key the volume's items name is projected.
    assert sorted(p.name for p in (root / "cm-set").iterdir()) == ["terminal.jsonl"]
    loaded = load_task_set(spec(data).tasks[1], tmp_path, str(root))
    assert [t.id for t in loaded.tasks] == ["count-words", "sort-unique"]


def test_the_loader_reads_a_pvc_file_under_the_root_and_names_an_unmounted_source(tmp_path) -> None:
    ts = spec(_sourced()).tasks[2]
    (tmp_path / "pvc-set" / "sets").mkdir(parents=True)
    (tmp_path / "pvc-set" / "sets" / "terminal.jsonl").write_text(TERMINAL)
    assert len(load_task_set(ts, Path.cwd(), str(tmp_path)).tasks) == 2
    with pytest.raises(EpisodeError, match=r"spec.tasks\[pvc-set\].source.pvc: .*KILN_TASKS_ROOT"):
        load_task_set(ts, Path.cwd(), None)


def test_kiln_run_refuses_a_cluster_source_by_field_and_writes_nothing(tmp_path: Path) -> None:
    job = tmp_path / "job.yaml"
    data = yaml.safe_load(_job_text({"name": "train", "env": "terminal", "source": CM}))
    data["spec"]["model"]["init"] = {"hiddenSize": 32}  # made later: the sources come first
    job.write_text(yaml.safe_dump(data))
    out, err = io.StringIO(), io.StringIO()
    run = tmp_path / "run"
    code = prepare(argparse.Namespace(job=job, run_dir=run, resume=None), out, err)
    assert code == 1
    assert "spec.tasks[0].source.configMap: the ConfigMap 'team-tasks' is on a cluster" in err.getvalue()
    assert not run.exists()


def test_the_dev_cluster_api_maps_core_kinds_for_kubectl_apply() -> None:
    """`kubectl apply -f` of a PVC or a ConfigMap (the example's header) maps its kind through
    the core group's resource list, keyed by its groupVersion `v1`."""
    import json
    import urllib.request

    from kiln.cli.devcluster.api import running_fake_api

    with running_fake_api() as (_, url):
        doc = json.loads(urllib.request.urlopen(f"{url}/api/v1", timeout=10).read())
        apps = json.loads(urllib.request.urlopen(f"{url}/apis/apps/v1", timeout=10).read())
    assert doc["groupVersion"] == "v1" and apps["groupVersion"] == "apps/v1"
    assert {"configmaps", "persistentvolumeclaims"} <= {r["name"] for r in doc["resources"]}
