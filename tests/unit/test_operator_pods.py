"""Pods as clusters need them: a component's own volumes and mounts (and the paths and names
Kiln keeps for itself), a memory-backed /dev/shm for the pods that run a model, accelerators by
resource name. Checked on the rendered manifests, which must also pass Kubernetes' schema."""
from __future__ import annotations

import copy
from typing import Any

import kubernetes_validate
import pytest

from kiln.operator import children, frozen
from kiln.operator.reconcile import parse_spec

from helpers.operator_jobs import FULL, JOB, SMALL, spec, workload

DATA = {"volumes": [{"name": "datasets", "persistentVolumeClaim": {"claimName": "team-data",
                                                                  "readOnly": True}},
                    {"name": "creds", "secret": {"secretName": "s3", "defaultMode": 0o440}}],
        "volumeMounts": [{"name": "datasets", "mountPath": "/data", "readOnly": True},
                         {"name": "creds", "mountPath": "/etc/creds", "subPath": "config"}]}


def _pod(objs: list[dict[str, Any]], component: str) -> dict[str, Any]:
    return workload(objs, component)["spec"]["template"]["spec"]


def _main(pod: dict[str, Any], name: str) -> dict[str, Any]:
    return next(c for c in pod["containers"] if c["name"] == name)


def test_volumes_and_mounts_reach_the_component_s_pods_only() -> None:
    data = {**SMALL, "trainer": {"pod": DATA}}
    objs = children.desired_children(JOB, spec(data))
    pod = _pod(objs, "trainer")
    assert [v for v in pod["volumes"] if v["name"] in ("datasets", "creds")] == DATA["volumes"]
    mounts = _main(pod, "trainer")["volumeMounts"]
    assert {"name": "datasets", "mountPath": "/data", "readOnly": True} in mounts
    assert {"name": "creds", "mountPath": "/etc/creds", "subPath": "config",
            "readOnly": False} in mounts
    assert not any(v["name"] == "datasets" for v in _pod(objs, "rollout")["volumes"])
    # A data-parallel replica runs the same trainer: it mounts the same volumes.
    dp = children.desired_children(JOB, spec({**data, "trainer": {"pod": DATA, "dataParallel": 2}}))
    replica = workload_named(dp, "StatefulSet", "demo-trainer-replica")["spec"]["template"]["spec"]
    assert any(m["name"] == "datasets" for m in _main(replica, "trainer")["volumeMounts"])


def workload_named(objs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    return next(o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name)


def test_pods_with_volumes_and_shm_pass_kubernetes_schema_validation() -> None:
    data = copy.deepcopy(FULL)
    data["rollout"]["pod"] = {**DATA, "shmSize": "8Gi"}
    data["sandbox"]["pod"] = DATA
    for obj in children.desired_children(JOB, spec(data)):
        kubernetes_validate.validate(obj, "1.30.0", strict=True)


def test_shm_is_memory_backed_for_engines_and_trainer_only() -> None:
    s = spec(FULL, rollout__pod={"shmSize": "16Gi"})
    objs = children.desired_children(JOB, s)
    sized = {"rollout": "16Gi", "trainer": "1Gi"}
    for component in ("rollout", "trainer", "sandbox", "weight-sync", "buffer"):
        pod = _pod(objs, component)
        shm = [v for v in pod["volumes"] if v["name"] == "dshm"]
        mounted = [m for c in pod["containers"] for m in c["volumeMounts"] if m["mountPath"] == "/dev/shm"]
        if component in sized:
            assert shm == [{"name": "dshm", "emptyDir": {"medium": "Memory",
                                                         "sizeLimit": sized[component]}}]
            assert mounted == [{"name": "dshm", "mountPath": "/dev/shm"}]
        else:
            assert shm == [] and mounted == [], component
    replica = workload_named(objs, "StatefulSet", "demo-trainer-replica")["spec"]["template"]["spec"]
    assert any(v["name"] == "dshm" for v in replica["volumes"])


def test_frozen_engines_get_shm_too() -> None:
    data = copy.deepcopy(SMALL)
    data["stages"] = [{**SMALL["stages"][0], "type": "opd",
                       "rl": {"groupSize": 8, "teacher": "models/teacher"}}]
    s = spec(data)
    _services, deployments = frozen.children(JOB, s, "hash", active=True)
    assert deployments, "the job should serve a frozen teacher"
    for dep in deployments:
        assert any(v["name"] == "dshm" for v in dep["spec"]["template"]["spec"]["volumes"])


@pytest.mark.parametrize("resource", ["nvidia.com/gpu", "amd.com/gpu", "nvidia.com/mig-1g.10gb"])
def test_accelerators_by_resource_name(resource: str) -> None:
    s = spec(FULL, trainer__resources={"cpu": "16", "memory": "128Gi", "gpu": 2,
                                       "gpuResource": resource})
    objs = children.desired_children(JOB, s)
    limits = _main(_pod(objs, "trainer"), "trainer")["resources"]["limits"]
    assert limits[resource] == 2
    assert [k for k in limits if k.endswith("/gpu") or "mig" in k] == [resource]
    # Rollout keeps its own (the default).
    rollout = _main(_pod(objs, "rollout"), "rollout")["resources"]["limits"]
    assert rollout["nvidia.com/gpu"] == 1 and resource not in rollout or resource == "nvidia.com/gpu"


def _problems(pod: dict[str, Any], component: str = "trainer", **section: Any) -> list[str]:
    data = copy.deepcopy(SMALL)
    data[component] = {"pod": pod, **section}
    return parse_spec("demo", data)[1]


@pytest.mark.parametrize("pod, field, words", [
    ({**DATA, "volumeMounts": [{"name": "nope", "mountPath": "/x"}]},
     "spec.trainer.pod", "volumeMounts[0].name: 'nope' is not one of volumes"),
    ({**DATA, "volumeMounts": [{"name": "datasets", "mountPath": "/var/lib/kiln/data"}]},
     "spec.trainer.pod.volumeMounts[0].mountPath", "overlaps /var/lib/kiln"),
    ({**DATA, "volumeMounts": [{"name": "datasets", "mountPath": "/etc/kiln"}]},
     "spec.trainer.pod.volumeMounts[0].mountPath", "overlaps /etc/kiln"),
    ({**DATA, "volumeMounts": [{"name": "datasets", "mountPath": "/var"}]},
     "spec.trainer.pod.volumeMounts[0].mountPath", "overlaps /var/lib/kiln"),
    ({**DATA, "volumeMounts": [{"name": "datasets", "mountPath": "/dev/shm"}]},
     "spec.trainer.pod.volumeMounts[0].mountPath", "overlaps /dev/shm"),
    ({**DATA, "volumeMounts": [{"name": "datasets", "mountPath": "data"}]},
     "spec.trainer.pod.volumeMounts[0].mountPath", "pattern"),
    ({"volumes": [{"name": "run", "emptyDir": {}}]}, "spec.trainer.pod.volumes[0].name",
     "'run' is a volume Kiln's pods use"),
    ({"volumes": [{"name": "tasks-0", "emptyDir": {}}]}, "spec.trainer.pod.volumes[0].name",
     "'tasks-0' is a volume Kiln's pods use"),
    ({**DATA, "volumeMounts": [{"name": "datasets", "mountPath": "/var/lib/kiln-output/x"}]},
     "spec.trainer.pod.volumeMounts[0].mountPath", "overlaps /var/lib/kiln-output"),
    ({"volumes": [{"name": "a", "emptyDir": {}}, {"name": "a", "emptyDir": {}}]},
     "spec.trainer.pod", "repeated: a"),
    ({"volumes": [{"name": "node", "hostPath": {"path": "/"}}]}, "spec.trainer.pod.volumes[0]",
     "hostPath volumes are not allowed"),
    ({"shmSize": "8Gi"}, "spec.trainer", "pod.shmSize (8Gi) exceeds resources.memory (4Gi)"),
])
def test_bad_pod_settings_are_refused_naming_the_field(pod: dict[str, Any], field: str,
                                                      words: str) -> None:
    problems = _problems(pod)
    assert len(problems) == 1, problems
    assert problems[0].startswith(field + ": ") and words in problems[0], problems


def test_shm_size_applies_to_engine_pods_only() -> None:
    assert "shmSize" in _problems({"shmSize": "1Gi"}, "buffer")[0]
    assert _problems({"shmSize": "2Gi"}, "rollout") == []


def test_a_bad_accelerator_name_is_refused() -> None:
    (problem,) = _problems({}, resources={"gpu": 1, "gpuResource": "gpu"})
    assert problem.startswith("spec.trainer.resources.gpuResource: ")


def test_every_folder_kiln_mounts_is_one_users_may_not_mount_over() -> None:
    """Guards KILN_PATHS: a new Kiln mount outside them would let a user's mount shadow it."""
    from kiln.api.scheduling import KILN_PATHS

    data = copy.deepcopy(FULL)
    data["stages"] = [{**FULL["stages"][0], "type": "opd",
                       "rl": {"groupSize": 8, "teacher": "models/teacher"}}]
    data["model"] = {**data["model"], "hub": {"id": "org/model", "tokenSecret": "hf"}}
    data["tasks"] = [*data["tasks"], {"name": "mine", "env": "terminal", "source": {
        "configMap": {"name": "team-tasks", "key": "tasks.jsonl"}}}]
    data["output"] = {"pvc": {"claim": "results"}}
    objs = children.desired_children(JOB, spec(data))
    seen = 0
    for obj in objs:
        if obj["kind"] not in ("Deployment", "StatefulSet"):
            continue
        pod = obj["spec"]["template"]["spec"]
        for c in [*pod["containers"], *pod.get("initContainers", [])]:
            if c["name"] == "dind":
                continue  # the Docker sidecar takes no user mounts
            for m in c["volumeMounts"]:
                seen += 1
                assert any(m["mountPath"] == p or m["mountPath"].startswith(p + "/")
                           for p in KILN_PATHS), (obj["metadata"]["name"], c["name"], m)
    assert seen > 20
