"""The operator's frozen deployments: one rollout Deployment, Service and NetworkPolicy per
distinct frozen checkpoint a job names (teachers, a KL reference, subagents, reward models),
wired into the rollout as `kiln run` wires its teacher processes."""
from __future__ import annotations

import copy
from typing import Any

import kubernetes_validate

from kiln.api.distillation import teacher_process
from kiln.api.spec import RLJobSpec
from kiln.control.driver import RunState
from kiln.operator import children, frozen
from kiln.operator.driving import StatusStore
from kiln.operator.naming import JobRef

JOB = JobRef(name="demo", namespace="team-a", uid="u-1")

STAGED: dict[str, Any] = {
    "model": {"path": "/models/base", "pvc": "models"},
    "rollout": {"resources": {"cpu": "8", "memory": "64Gi", "gpu": 1}},
    "sandbox": {"replicas": 0},
    "tasks": [
        {"name": "a", "env": "chain", "generate": {"count": 8}},
        {"name": "b", "env": "chain", "generate": {"count": 8, "seed": 5},
         "rewardRules": {"judge": {"model": "sft", "rubric": "Is it right?"}}},
    ],
    "stages": [
        {"name": "sft", "type": "sft", "tasks": ["a"], "batchSize": 8, "microBatchSize": 8},
        {"name": "rl", "type": "rl", "tasks": ["a"], "batchSize": 8, "microBatchSize": 8,
         "rl": {"groupSize": 8, "klCoef": 0.01, "reference": "sft"}},
        {"name": "opd", "type": "rl", "tasks": ["a", "b"], "batchSize": 8, "microBatchSize": 8,
         "rl": {"groupSize": 8, "advantage": "opd",
                "teachers": [{"teacher": "rl", "tasks": ["a"]},
                             {"teacher": "/models/skill-b", "tasks": ["b"]}]}},
    ],
}


def by_name(objs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {f"{o['kind']}/{o['metadata']['name']}": o for o in objs}


def pod(obj: dict[str, Any]) -> dict[str, Any]:
    return obj["spec"]["template"]["spec"]


def env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def test_each_distinct_frozen_checkpoint_gets_a_deployment_started_when_its_stage_is_done() -> None:
    spec = RLJobSpec.model_validate(STAGED)
    # sft (the reference and the judge: one deployment), rl, and a checkpoint directory.
    assert frozen.frozen(spec) == [("teacher", "sft", "sft"), ("teacher-1", "rl", "rl"),
                                   ("teacher-2", "/models/skill-b", None)]
    first = by_name(children.desired_children(JOB, spec))
    for obj in first.values():
        kubernetes_validate.validate(obj, "1.30.0", strict=True)
    replicas = {n: first[f"Deployment/demo-{n}"]["spec"]["replicas"] for n in frozen.components(spec)}
    # A stage's weights do not exist before it ends; a directory is there from the start.
    assert replicas == {"teacher": 0, "teacher-1": 0, "teacher-2": 1}
    later = by_name(children.desired_children(JOB, spec, finished_stages=["sft"]))
    assert later["Deployment/demo-teacher"]["spec"]["replicas"] == 1
    assert later["Deployment/demo-teacher-1"]["spec"]["replicas"] == 0
    idle = by_name(children.desired_children(JOB, spec, active=False, finished_stages=["sft", "rl"]))
    assert all(idle[f"Deployment/demo-{n}"]["spec"]["replicas"] == 0 for n in replicas)

    teacher = later["Deployment/demo-teacher"]
    (c,) = pod(teacher)["containers"]
    assert c["command"] == ["kiln-rollout"]
    assert c["args"][-4:] == ["--teacher", frozen.TEACHER_DIR, "--teacher-stage", "sft"]
    assert pod(first["Deployment/demo-teacher-2"])["containers"][0]["args"][-2:] == [
        "--teacher", "/models/skill-b"]
    # The rollout's resources and scheduling, but a certificate of its own identity (`teacher`:
    # it may fetch weights, not Put or Exec); its own component label, so neither Service
    # selects the other's pods.
    rollout = first["Deployment/demo-rollout"]
    assert c["resources"] == pod(rollout)["containers"][0]["resources"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    tls = {v["name"]: v for v in pod(teacher)["volumes"]}["tls"]
    assert tls["secret"]["secretName"] == "demo-teacher-tls"
    assert {"name": "model", "persistentVolumeClaim": {"claimName": "models", "readOnly": True}} in pod(teacher)["volumes"]
    labels = teacher["spec"]["template"]["metadata"]["labels"]
    assert labels["app.kubernetes.io/component"] == "teacher"
    assert not first["Service/demo-rollout"]["spec"]["selector"].items() <= labels.items()
    assert first["Service/demo-teacher"]["spec"]["selector"].items() <= labels.items()
    assert env(c)["KILN_COMPONENT"] == "teacher" and env(c)["KILN_TRAINER_ADDR"] == "demo-trainer:50051"

    # The rollout finds each where `kiln-rollout` looks (`teacher_process` order).
    wired = env(pod(rollout)["containers"][0])
    for i, name in enumerate(frozen.components(spec)):
        assert wired[f"KILN_{teacher_process(i).upper()}_ADDR"] == f"demo-{name}:50051"


def test_frozen_deployments_admit_the_rollout_and_reach_the_trainer_only_to_fetch() -> None:
    spec = RLJobSpec.model_validate(STAGED)
    objs = by_name(children.desired_children(JOB, spec))
    policy = objs["NetworkPolicy/demo-teacher-2"]["spec"]
    assert policy["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "teacher-2"
    grpc_from = policy["ingress"][0]["from"]
    assert grpc_from[1]["podSelector"]["matchExpressions"][0]["values"] == ["rollout"]
    assert grpc_from[0]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "operator"
    # The trainer takes gRPC from the operator and from the two deployments that fetch a
    # stage's weights; not from the rollout, nor from the one reading a directory.
    trainer_from = objs["NetworkPolicy/demo-trainer"]["spec"]["ingress"][0]["from"]
    assert trainer_from[1]["podSelector"]["matchExpressions"][0]["values"] == ["teacher", "teacher-1"]
    plain = by_name(children.desired_children(JOB, RLJobSpec.model_validate(
        {**STAGED, "tasks": STAGED["tasks"][:1], "stages": STAGED["stages"][:1]})))
    assert len(plain["NetworkPolicy/demo-trainer"]["spec"]["ingress"][0]["from"]) == 1
    assert not [k for k in plain if "teacher" in k]


def test_an_edit_naming_fewer_checkpoints_leaves_their_children_to_delete() -> None:
    spec = RLJobSpec.model_validate(STAGED)
    fewer = copy.deepcopy(STAGED)
    fewer["stages"][2]["rl"]["teachers"] = [{"teacher": "rl", "tasks": ["a", "b"]}]
    stale = frozen.stale(JOB, spec, RLJobSpec.model_validate(fewer))
    assert sorted((r["kind"], r["metadata"]["name"]) for r in stale) == [
        ("Deployment", "demo-teacher-2"), ("NetworkPolicy", "demo-teacher-2"),
        ("Service", "demo-teacher-2")]
    assert frozen.stale(JOB, spec, spec) == []


class StatusKube:
    def __init__(self, status: dict[str, Any]) -> None:
        self.status = status

    def merge_patch_status(self, ref: dict, status: dict) -> None:
        self.status.update(status)


def test_the_status_store_says_when_a_stage_is_done_and_only_then() -> None:
    kube = StatusKube({"finishedStages": ["sft"]})
    seen: list[list[str]] = []
    state = RunState.load(StatusStore(kube, JOB, lambda: kube.status, seen.append))
    state.save()  # an evaluation, say: no stage finished
    assert seen == []
    state.finished_stages.append("rl")
    state.save()
    state.save()
    assert seen == [["sft", "rl"]]
