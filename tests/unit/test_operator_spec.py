"""The operator's pure functions on a job's spec: the job file it writes for the services (the
spec resolved, without the pod settings, which reach the pods alone), the config hashes that
restart only the components a change reaches, immutable fields, spec parsing that names field
paths, Kubernetes quantities, and the sandboxes it admits only where the admin allows.

Plain functions on `RLJobSpec`s, no cluster; the manifests built from them are
`test_operator_children.py`'s."""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from kiln.api.base import quantity_value
from kiln.api.scheduling import EnginePodSettings
from kiln.api.spec import RLJobSpec
from kiln.api.validate import load_job
from kiln.operator import children
from kiln.operator.naming import COMPONENTS
from kiln.operator.reconcile import parse_spec

from helpers.operator_jobs import FULL, JOB, SMALL, by_name, spec


def test_job_file_round_trips_through_the_services_loader(tmp_path: Path) -> None:
    s = spec(FULL, stages=[{**FULL["stages"][0], "rl": {"groupSize": 8, "loss": {"mode": "ppo", "icepopBeta": None}}}])
    cm = children.config_map(JOB, s)
    path = tmp_path / "job.yaml"
    path.write_text(cm["data"]["job.yaml"])
    job = load_job(path)
    assert job.metadata.name == "demo"
    # Everything but the pod settings, which only the operator reads.
    assert job.spec == RLJobSpec.model_validate(
        children.without_pod_settings(children.resolved_spec(s)))
    assert job.spec.trainer.pod == EnginePodSettings() != s.trainer.pod
    assert job.spec.stages[0].rl.loss.icepop_beta is None  # an explicit null is not lost to the default


def test_config_hashes_restart_only_the_components_that_read_a_change() -> None:
    base = children.component_hashes(spec(SMALL))
    assert set(base) == set(COMPONENTS)

    def changed(**kw: Any) -> set[str]:
        new = children.component_hashes(spec(SMALL, **kw))
        return {c for c in base if new[c] != base[c]}

    assert changed(rollout__replicas=5) == set()
    assert changed(sandbox__replicas=3) == set()
    assert changed(suspend=True) == set()
    assert changed(sandbox__timeoutSeconds=9) == {"sandbox"}
    assert changed(rollout__maxTurns=3) == {"rollout"}
    assert changed(trainer__checkpointInterval=7) == {"trainer"}
    assert changed(weightSync__bucketBytes=8192) == {"weight-sync"}
    assert changed(buffer__capacity=10) == {"buffer"}
    stages = copy.deepcopy(SMALL["stages"])
    stages[0]["rl"]["tau"] = 1
    assert changed(stages=stages) == {"trainer", "rollout", "buffer"}


def test_immutable_changes_name_the_field() -> None:
    old = spec(FULL)
    assert children.immutable_changes(old, spec(FULL, rollout__replicas=1)) == []
    msgs = children.immutable_changes(old, spec(FULL, model__path="other", trainer__tensorParallel=4))
    assert len(msgs) == 2
    assert any(m.startswith("spec.model.path cannot change") and "'other'" in m for m in msgs)
    assert any(m.startswith("spec.trainer.tensorParallel cannot change") for m in msgs)


def test_parse_spec_reports_field_paths() -> None:
    ok, problems = parse_spec("demo", copy.deepcopy(SMALL))
    assert ok is not None and problems == []
    bad = copy.deepcopy(SMALL)
    bad["rollout"] = {"replicas": -1, "engine": "tgi"}
    parsed, problems = parse_spec("demo", bad)
    assert parsed is None
    assert any(p.startswith("spec.rollout.replicas:") for p in problems)
    assert any(p.startswith("spec.rollout.engine:") and "tgi" in p for p in problems)


@pytest.mark.parametrize("text,value", [("512Mi", 512 * 2**20), ("1.5", 1.5), ("250m", 0.25),
                                        ("2G", 2e9), ("4Gi", 4 * 2**30)])
def test_quantity_value(text: str, value: float) -> None:
    assert quantity_value(text) == pytest.approx(value)


def test_pod_settings_reach_the_pod_and_stay_out_of_the_config_map() -> None:
    objs = by_name(children.desired_children(JOB, spec(FULL)))
    pod = objs["StatefulSet/demo-trainer"]["spec"]["template"]
    ps = pod["spec"]
    assert ps["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert ps["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert "nodeAffinity" in ps["affinity"]
    assert ps["imagePullSecrets"] == [{"name": "registry"}]
    assert ps["priorityClassName"] == "training" and ps["serviceAccountName"] == "kiln-trainer"
    assert ps["automountServiceAccountToken"] is False
    (container,) = ps["containers"]
    env = {e["name"]: e for e in container["env"]}
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf", "key": "token"}
    assert "KILN_BUFFER_ADDR" in env  # Kiln's own variables are still there
    assert container["envFrom"] == [{"secretRef": {"name": "wandb"}}]
    assert pod["metadata"]["labels"]["team"] == "rl"
    assert pod["metadata"]["labels"]["app.kubernetes.io/component"] == "trainer"
    assert pod["metadata"]["annotations"]["owner"] == "rl-team"
    # Other components are untouched; the job file carries no pod section (env values may be
    # secrets written inline).
    assert "nodeSelector" not in objs["Deployment/demo-rollout"]["spec"]["template"]["spec"]
    job_file = objs["ConfigMap/demo-config"]["data"]["job.yaml"]
    assert "HF_TOKEN" not in job_file and "pod" not in yaml.safe_load(job_file)["spec"]["trainer"]


@pytest.mark.parametrize("field, value, message", [
    ("labels", {"app.kubernetes.io/name": "x"}, "set by Kiln"),
    ("env", [{"name": "KILN_JOB_NAME", "value": "x"}], "KILN_"),
    ("env", [{"name": "A"}], "needs value or valueFrom"),
])
def test_pod_settings_refuse_what_kiln_sets(field: str, value: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        spec(SMALL, trainer__pod={field: value})


def test_operator_admits_sandboxes_only_where_the_admin_allows() -> None:
    from kiln.operator.config import OperatorConfig
    for backend in ("bubblewrap", "docker"):
        job = spec({**SMALL, "sandbox": {"backend": backend}})
        (why,) = OperatorConfig().refusals(job)
        assert backend in why and "sandboxRuntimeClass" in why and "allowPrivilegedSandboxes" in why
        for setting in ({"KILN_OPERATOR_ALLOW_PRIVILEGED_SANDBOXES": "true"},
                        {"KILN_OPERATOR_SANDBOX_RUNTIME_CLASS": "kata"}):
            assert OperatorConfig.from_env(setting).refusals(job) == []
    assert OperatorConfig().refusals(spec({**SMALL, "sandbox": {"replicas": 0}})) == []
    # Frozen deployments (teachers, subagents) are the operator's to make (`frozen.py`).
    opd = spec({**SMALL, "sandbox": {"replicas": 0}, "stages": [{**SMALL["stages"][0], "rl": {
        "groupSize": 8, "advantage": "opd", "teacher": "/models/teacher"}}]})
    swarm = spec({**SMALL, "sandbox": {"replicas": 0}, "stages": [{**SMALL["stages"][0], "swarm": {
        "subagents": "/models/subagents"}}]})
    assert OperatorConfig().refusals(opd) == OperatorConfig().refusals(swarm) == []


def test_an_openai_endpoint_without_an_api_key_secret_is_refused() -> None:
    from kiln.operator.config import OperatorConfig
    bare = spec({**SMALL, "sandbox": {"replicas": 0}, "rollout": {"openaiPort": 8000}})
    (why,) = OperatorConfig().refusals(bare)
    assert "apiKeySecret" in why
    keyed = spec({**SMALL, "sandbox": {"replicas": 0},
                  "rollout": {"openaiPort": 8000, "openai": {"apiKeySecret": "agents"}}})
    assert OperatorConfig().refusals(keyed) == []
