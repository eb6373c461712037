"""The operator's child manifests, a pure function of the job: every child valid against
Kubernetes' own schemas (1.30 and the latest; the example jobs' children too) and owned by the
job; the service containers' commands, TLS, probes, ports, resources and bounded disks; the
docker sandbox's sidecar; suspension; data-parallel trainer replicas; network policies;
privileges and runtime class.

Checked on the manifests themselves (no cluster): `kubernetes_validate` rejects what an API
server would, so a child that passes here is one a cluster accepts. What the operator reads
from a spec (the job file, config hashes, immutable fields) is `test_operator_spec.py`'s."""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest

from kiln.api.validate import load_job
from kiln.operator import children
from kiln.operator.naming import COMPONENTS, JobRef

from helpers.operator_jobs import FULL, JOB, SMALL, by_name, spec, workload

K8S_VERSIONS = ("1.30.0", kubernetes_validate.latest_version())


@pytest.mark.parametrize("data", [SMALL, FULL], ids=["small", "full"])
@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_children_pass_kubernetes_schema_validation(data: dict[str, Any], version: str) -> None:
    objs = children.desired_children(JOB, spec(data))
    # 13 children and a NetworkPolicy per component; FULL adds the trainer's DP replicas and
    # the OpenAI endpoint's router (Deployment, Service, NetworkPolicy).
    assert len(objs) == (22 if data is FULL else 18)
    for obj in objs:
        kubernetes_validate.validate(obj, version, strict=True)


def test_schema_validation_catches_a_bad_manifest() -> None:
    # Guards the test above: the validator rejects what a cluster would.
    obj = copy.deepcopy(workload(children.desired_children(JOB, spec(SMALL)), "rollout"))
    obj["spec"]["template"]["spec"]["containers"][0]["resourcez"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(obj, "1.30.0", strict=True)


def test_every_child_is_owned_and_labelled() -> None:
    for obj in children.desired_children(JOB, spec(FULL)):
        meta = obj["metadata"]
        assert meta["namespace"] == "team-a"
        assert meta["ownerReferences"] == [{
            "apiVersion": "kiln.dev/v1alpha1", "kind": "RLJob", "name": "demo", "uid": JOB.uid,
            "controller": True, "blockOwnerDeletion": True}]
        labels = meta["labels"]
        assert labels["app.kubernetes.io/name"] == "kiln"
        assert labels["app.kubernetes.io/instance"] == "demo"
        assert labels["app.kubernetes.io/managed-by"] == "kiln-operator"
        assert labels["app.kubernetes.io/version"] == "0.1.0"
        if obj["kind"] in ("Deployment", "StatefulSet"):
            selector = obj["spec"]["selector"]["matchLabels"]
            template_labels = obj["spec"]["template"]["metadata"]["labels"]
            assert selector.items() <= template_labels.items()


def test_service_containers_run_the_component_with_spec_resources_and_grpc_probes() -> None:
    objs = children.desired_children(JOB, spec(FULL))
    expected = {"trainer": FULL["trainer"]["resources"], "rollout": FULL["rollout"]["resources"],
                "sandbox": {"cpu": "1", "memory": "4Gi", "gpu": 0}}
    for component in COMPONENTS:
        pod = workload(objs, component)["spec"]["template"]["spec"]
        main = next(c for c in pod["containers"] if c["name"] == component)
        assert main["image"] == "registry.example.com/kiln:0.1.0"
        assert main["command"] == [f"kiln-{component}"]
        assert main["args"] == ["--job", "/etc/kiln/job.yaml", "--address", "0.0.0.0:50051",
                                "--metrics-port", "9090", "--run-dir", "/var/lib/kiln",
                                "--health-address", "0.0.0.0:50050"]
        # The kubelet's probes cannot speak TLS: they use the plain-text, health-only port.
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert main[probe]["grpc"] == {"port": 50050}
        env = {e["name"]: e.get("value") for e in main["env"]}
        # Mutual TLS with the component's own certificate.
        assert env["KILN_TLS_DIR"] == "/etc/kiln/tls"
        assert {"name": "tls", "mountPath": "/etc/kiln/tls", "readOnly": True} in main["volumeMounts"]
        assert {"name": "tls", "secret": {"secretName": f"demo-{component}-tls", "defaultMode": 0o440}} \
            in pod["volumes"]
        assert env["KILN_BUFFER_ADDR"] == "demo-buffer:50051"
        assert env["KILN_WEIGHT_SYNC_ADDR"] == "demo-weight-sync:50051"
        assert env["KILN_TRAINER_ADDR"] == "demo-trainer:50051"
        if component in expected:
            res = expected[component]
            requests = dict(main["resources"]["requests"])
            assert requests.pop("ephemeral-storage")  # every pod's local disk is bounded
            assert requests == {"cpu": res["cpu"], "memory": res["memory"]}
            assert main["resources"]["limits"].get("nvidia.com/gpu", 0) == res["gpu"]
    trainer_pod = workload(objs, "trainer")["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in trainer_pod["volumes"]}
    assert volumes["run"]["persistentVolumeClaim"]["claimName"] == "demo-checkpoints"
    assert volumes["model"]["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}
    buffer_volumes = {v["name"]: v for v in workload(objs, "buffer")["spec"]["template"]["spec"]["volumes"]}
    assert buffer_volumes["run"]["persistentVolumeClaim"]["claimName"] == "demo-buffer"
    assert workload(objs, "buffer")["spec"]["strategy"] == {"type": "Recreate"}
    assert workload(objs, "rollout")["spec"]["replicas"] == 4
    assert workload(objs, "sandbox")["spec"]["replicas"] == 2
    pvcs = {k: v for k, v in by_name(objs).items() if k.startswith("PersistentVolumeClaim/")}
    assert pvcs["PersistentVolumeClaim/demo-buffer"]["spec"]["storageClassName"] == "fast"
    assert pvcs["PersistentVolumeClaim/demo-checkpoints"]["spec"]["resources"]["requests"] == {
        "storage": "200Gi"}


def test_the_openai_endpoint_gets_a_container_port_and_a_router_only_when_asked() -> None:
    for data, want in ((FULL, [8000]), (SMALL, [])):
        objs = children.desired_children(JOB, spec(data))
        pod = workload(objs, "rollout")["spec"]["template"]["spec"]
        # The API keys: the job's Secret, mounted into the rollout and router containers alone.
        keys = [v for v in pod["volumes"] if v["name"] == "openai-keys"]
        assert keys == ([{"name": "openai-keys", "secret": {"secretName": "agents", "defaultMode": 0o440}}]
                        if want else [])
        env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
        assert (env.get("KILN_OPENAI_API_KEYS"), env.get("KILN_OPENAI_HOST")) == (
            ("/etc/kiln/openai-keys", "0.0.0.0") if want else (None, None))
        for c in COMPONENTS:
            if c != "rollout":
                other = workload(objs, c)["spec"]["template"]["spec"]
                assert all(v["name"] != "openai-keys" for v in other["volumes"])
        ports = [p["containerPort"] for p in pod["containers"][0]["ports"] if p["name"] == "openai"]
        assert ports == want
        # Outside agents connect to the router's Service; no component Service has the port.
        services = [by_name(objs)[f"Service/demo-{c}"]["spec"]["ports"] for c in COMPONENTS]
        assert all(p["name"] != "openai" for ports_ in services for p in ports_)
        named = by_name(objs)
        if not want:
            assert not any(k.endswith(("/demo-router", "/demo-openai")) for k in named)
            continue
        router = named["Deployment/demo-router"]["spec"]
        assert router["replicas"] == 2
        (container,) = router["template"]["spec"]["containers"]
        assert container["args"][container["args"].index("--discover-dns") + 1] == \
            "demo-rollout.team-a.svc:8000"
        assert container["args"][container["args"].index("--port") + 1] == "8000"
        assert router["template"]["spec"]["volumes"] == keys
        assert container["securityContext"]["runAsNonRoot"] is True
        assert router["template"]["spec"]["automountServiceAccountToken"] is False
        assert named["Service/demo-openai"]["spec"]["selector"] == router["selector"]["matchLabels"]
        assert [p["port"] for p in named["Service/demo-openai"]["spec"]["ports"]] == [8000]
        stopped = by_name(children.desired_children(JOB, spec(data), active=False))
        assert stopped["Deployment/demo-router"]["spec"]["replicas"] == 0


def test_docker_sandbox_gets_a_privileged_dind_sidecar_sized_from_the_spec() -> None:
    pod = workload(children.desired_children(JOB, spec(FULL)), "sandbox")["spec"]["template"]["spec"]
    (dind,) = pod["initContainers"]
    assert dind["image"].startswith("docker:") and "dind" in dind["image"]
    assert dind["restartPolicy"] == "Always" and dind["securityContext"] == {"privileged": True}
    # 16 sandboxes of 0.5 CPU and 1 GiB at most, each with its 1 GiB tmpfs workspace (memory
    # too); one guaranteed.
    assert dind["resources"]["limits"] == {"cpu": "8000m", "memory": "32768Mi",
                                           "ephemeral-storage": "8Gi"}
    assert dind["resources"]["requests"] == {"cpu": "500m", "memory": "2048Mi",
                                             "ephemeral-storage": "8Gi"}
    main = pod["containers"][0]
    assert {"name": "DOCKER_HOST", "value": "unix:///run/dind/docker.sock"} in main["env"]
    plain = workload(children.desired_children(JOB, spec(SMALL)), "sandbox")["spec"]["template"]["spec"]
    assert "initContainers" not in plain
    assert plain["containers"][0]["securityContext"]["privileged"] is True  # bubblewrap


def test_local_disk_is_bounded_and_covers_the_sandbox_workspaces() -> None:
    """Every container has an ephemeral-storage limit and every scratch emptyDir a sizeLimit;
    the bubblewrap sandbox pod's covers maxConcurrent workspace images on top."""
    data = {**SMALL, "sandbox": {"maxConcurrent": 8, "disk": "512Mi"}}
    objs = children.desired_children(JOB, spec(data))
    for component in COMPONENTS:
        pod = workload(objs, component)["spec"]["template"]["spec"]
        for c in pod["containers"]:
            assert c["resources"]["limits"]["ephemeral-storage"], (component, c["name"])
        for v in pod["volumes"]:
            if "emptyDir" in v and v["emptyDir"].get("medium") != "Memory":
                assert v["emptyDir"]["sizeLimit"] == "8Gi", (component, v)
    box = workload(objs, "sandbox")["spec"]["template"]["spec"]["containers"][0]
    assert box["resources"]["limits"]["ephemeral-storage"] == f"{8192 + 8 * 512}Mi"
    tmpfs = spec({**SMALL, "sandbox": {"maxConcurrent": 8, "workspaceFs": "tmpfs"}})
    box = workload(children.desired_children(JOB, tmpfs), "sandbox")["spec"]["template"]["spec"]
    assert box["containers"][0]["resources"]["limits"]["ephemeral-storage"] == "8Gi"


def test_suspend_scales_every_workload_to_zero_with_the_same_templates() -> None:
    running = children.desired_children(JOB, spec(FULL))
    stopped = children.desired_children(JOB, spec(FULL, suspend=True), active=False)
    for component in COMPONENTS:
        assert workload(stopped, component)["spec"]["replicas"] == 0
        assert (workload(stopped, component)["spec"]["template"]
                == workload(running, component)["spec"]["template"])
    kinds = [o["kind"] for o in stopped]
    assert kinds.count("PersistentVolumeClaim") == 2


EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "deploy" / "examples").glob("*.yaml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_manifests_become_valid_children(path: Path) -> None:
    job = load_job(path)
    ref = JobRef(job.metadata.name, "default", "uid")
    for obj in children.desired_children(ref, job.spec):
        kubernetes_validate.validate(obj, "1.30.0", strict=True)


def _env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def test_data_parallel_trainer_replicas_meet_at_trainer_pod_zero() -> None:
    objs = by_name(children.desired_children(JOB, spec(FULL)))
    leader, replicas = objs["StatefulSet/demo-trainer"], objs["StatefulSet/demo-trainer-replica"]
    assert leader["spec"]["replicas"] == 1 and replicas["spec"]["replicas"] == 2
    lead_c = leader["spec"]["template"]["spec"]["containers"][0]
    rep_c = replicas["spec"]["template"]["spec"]["containers"][0]
    rendezvous = "demo-trainer-0.demo-trainer.team-a.svc"
    assert _env(lead_c)["MASTER_ADDR"] == _env(rep_c)["MASTER_ADDR"] == rendezvous
    assert _env(lead_c)["MASTER_PORT"] == _env(rep_c)["MASTER_PORT"] == "29500"
    assert _env(lead_c)["KILN_TRAINER_REPLICA"] == "0"
    assert _env(rep_c)["KILN_TRAINER_REPLICA_OFFSET"] == "1" and "KILN_TRAINER_REPLICA" not in _env(rep_c)
    assert {"name": "rendezvous", "containerPort": 29500, "protocol": "TCP"} in lead_c["ports"]
    # Same image, command, resources and scheduling; only replica 0 holds the checkpoints.
    for key in ("image", "command", "args", "resources"):
        assert lead_c[key] == rep_c[key]
    assert rep_c["resources"]["limits"]["nvidia.com/gpu"] == 2  # one GPU per TP rank
    assert (replicas["spec"]["template"]["spec"]["tolerations"]
            == leader["spec"]["template"]["spec"]["tolerations"])
    volumes = {v["name"]: v for v in replicas["spec"]["template"]["spec"]["volumes"]}
    assert volumes["run"] == {"name": "run", "emptyDir": {"sizeLimit": "8Gi"}}
    lead_volumes = {v["name"]: v for v in leader["spec"]["template"]["spec"]["volumes"]}
    assert lead_volumes["run"]["persistentVolumeClaim"]["claimName"] == "demo-checkpoints"
    # The trainer Service (Trainer RPCs: replica 0 alone) does not select the replicas, whose
    # pods resolve under it as the StatefulSet's governing Service.
    svc = objs["Service/demo-trainer"]["spec"]
    rep_labels = replicas["spec"]["template"]["metadata"]["labels"]
    assert not svc["selector"].items() <= rep_labels.items()
    assert svc["selector"].items() <= leader["spec"]["template"]["metadata"]["labels"].items()
    assert replicas["spec"]["serviceName"] == "demo-trainer" and svc["publishNotReadyAddresses"]
    # One replica: no rendezvous, no replica StatefulSet.
    small = by_name(children.desired_children(JOB, spec(SMALL)))
    assert "StatefulSet/demo-trainer-replica" not in small
    assert "MASTER_ADDR" not in _env(
        small["StatefulSet/demo-trainer"]["spec"]["template"]["spec"]["containers"][0])
    # Suspended: the replicas scale to zero with the rest.
    idle = by_name(children.desired_children(JOB, spec(FULL), active=False))
    assert idle["StatefulSet/demo-trainer-replica"]["spec"]["replicas"] == 0


def test_network_policies_admit_only_each_components_clients() -> None:
    objs = by_name(children.desired_children(JOB, spec(FULL)))
    sandbox = objs["NetworkPolicy/demo-sandbox"]["spec"]
    assert sandbox["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "sandbox"
    grpc_rule, open_rule = sandbox["ingress"][:2]
    assert grpc_rule["ports"] == [{"port": 50051, "protocol": "TCP"}]
    assert grpc_rule["from"] == [{"podSelector": {
        "matchLabels": {"app.kubernetes.io/instance": "demo"},
        "matchExpressions": [{"key": "app.kubernetes.io/component", "operator": "In",
                              "values": ["rollout"]}]}}]
    assert "from" not in open_rule and {p["port"] for p in open_rule["ports"]} == {50050, 9090}
    buffer = objs["NetworkPolicy/demo-buffer"]["spec"]["ingress"][0]["from"]
    assert buffer[0] == {"namespaceSelector": {}, "podSelector": {"matchLabels": {
        "app.kubernetes.io/part-of": "kiln", "app.kubernetes.io/component": "operator"}}}
    assert buffer[1]["podSelector"]["matchExpressions"][0]["values"] == ["trainer", "rollout"]
    trainer = objs["NetworkPolicy/demo-trainer"]["spec"]
    assert trainer["podSelector"]["matchExpressions"][0]["values"] == ["trainer", "trainer-replica"]
    assert {"from": [{"podSelector": trainer["podSelector"]}]} in trainer["ingress"]  # rank to rank
    rollout = objs["NetworkPolicy/demo-rollout"]["spec"]["ingress"]
    # The rollout pods' OpenAI port: from the router's pods alone.
    assert {"from": [{"podSelector": {"matchLabels": {
        "app.kubernetes.io/name": "kiln", "app.kubernetes.io/instance": "demo",
        "app.kubernetes.io/component": "router"}}}],
            "ports": [{"port": 8000, "protocol": "TCP"}]} in rollout
    assert all("from" in r for r in rollout if 8000 in [p["port"] for p in r.get("ports", [])])
    # The router's: by default only the namespace's pods labelled as the endpoint's clients.
    router = objs["NetworkPolicy/demo-router"]["spec"]["ingress"]
    assert {"from": [{"podSelector": {"matchLabels": {"kiln.dev/openai-client": "true"}}}],
            "ports": [{"port": 8000, "protocol": "TCP"}]} in router
    assert all("from" in r for r in router if 8000 in [p["port"] for p in r.get("ports", [])])
    named = by_name(children.desired_children(JOB, spec(FULL, rollout__openai__allowedPeers=[
        {"cidr": "10.1.0.0/16"}, {"podLabels": {"app": "agents"}, "namespaceLabels": {"team": "a"}}])))
    (rule,) = [r for r in named["NetworkPolicy/demo-router"]["spec"]["ingress"]
               if r["ports"] == [{"port": 8000, "protocol": "TCP"}]]
    assert rule["from"] == [{"ipBlock": {"cidr": "10.1.0.0/16"}},
                            {"namespaceSelector": {"matchLabels": {"team": "a"}},
                             "podSelector": {"matchLabels": {"app": "agents"}}}]


def test_sandbox_pod_privileges_and_runtime_class() -> None:
    """bubblewrap: the sandbox container itself is privileged root (cgroups, mounts); docker:
    only the dind sidecar is. Every other container is unprivileged. The operator's
    RuntimeClass goes on the sandbox pod only."""
    from kiln.operator.workloads import SandboxHosting
    for data in (SMALL, FULL):
        objs = children.desired_children(JOB, spec(data), hosting=SandboxHosting(runtime_class="kata"))
        for component in COMPONENTS:
            pod = workload(objs, component)["spec"]["template"]["spec"]
            assert pod.get("runtimeClassName") == ("kata" if component == "sandbox" else None)
            main = next(c for c in pod["containers"] if c["name"] == component)
            if component == "sandbox" and data is SMALL:
                assert main["securityContext"]["privileged"] is True
            else:
                assert main["securityContext"]["runAsNonRoot"] is True
                assert main["securityContext"]["capabilities"] == {"drop": ["ALL"]}


def test_an_edit_dropping_the_openai_port_leaves_the_routers_children_to_delete() -> None:
    from kiln.operator import router

    with_port, without = spec(FULL), spec(FULL, rollout__openaiPort=None)
    assert sorted((r["kind"], r["metadata"]["name"]) for r in router.stale(JOB, with_port, without)) == [
        ("Deployment", "demo-router"), ("NetworkPolicy", "demo-router"), ("Service", "demo-openai")]
    assert router.stale(JOB, with_port, with_port) == [] == router.stale(JOB, without, with_port)
