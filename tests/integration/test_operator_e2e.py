"""End-to-end: the real operator (kopf, in-process via KopfRunner) against a fake API server.

The API server is `kiln.cli.devcluster.api.KubeApiFake` (no real one can run here). Each test creates its
own RLJob through the Kubernetes client, as `kubectl apply` would, and waits for the operator to act. Status comes over real gRPC: a real `kiln-buffer` process and a trainer health server,
both on unix sockets named after the job (`KILN_OPERATOR_ADDRESS_TEMPLATE`).
"""
from __future__ import annotations

import base64
import copy
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kiln.cli.devcluster.api import RLJOBS, running_fake_api, write_kubeconfig
from kiln.protos.kiln.v1 import trainer_pb2, trainer_pb2_grpc
from kiln.services.common.tls import server_credentials
from kiln.control.channels import channel as tls_channel
from kiln.tls import read_bundle

from helpers.operator_runner import wait_for

NS = "kiln-e2e"
GROUP, VERSION, PLURAL = "kiln.dev", "v1alpha1", "rljobs"
WORKLOADS = ("apps/v1/statefulsets", "apps/v1/deployments")

BASE_SPEC: dict[str, Any] = {
    "model": {"path": "models/tiny", "init": {"hiddenSize": 32, "numLayers": 1}},
    "tasks": [{"name": "train", "env": "chain", "generate": {"count": 16}}],
    "stages": [{"name": "rl", "type": "rl", "tasks": ["train"], "maxSteps": 4, "batchSize": 8,
                "microBatchSize": 8, "rl": {"groupSize": 8, "tau": 2}}],
    "rollout": {"replicas": 1},
}


def manifest(name: str, **spec_changes: Any) -> dict[str, Any]:
    spec = copy.deepcopy(BASE_SPEC)
    spec.update(spec_changes)
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "RLJob", "metadata": {"name": name},
            "spec": spec}


class Cluster:
    """The fake API server seen through a Kubernetes client, plus gRPC stand-ins per job."""

    def __init__(self, fake: Any, api: Any, sockets: Path) -> None:
        self.fake, self.api, self.sockets = fake, api, sockets
        self._cleanup: list[Callable[[], None]] = []

    def create(self, body: dict[str, Any]) -> None:
        self.api.create_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, body)

    def patch_spec(self, name: str, spec: dict[str, Any]) -> None:
        self.api.patch_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, name, {"spec": spec},
                                                _content_type="application/merge-patch+json")

    def delete(self, name: str) -> None:
        self.api.delete_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, name)

    def job(self, name: str) -> dict[str, Any] | None:
        return self.fake.stored(RLJOBS, NS, name)

    def status(self, name: str) -> dict[str, Any]:
        return (self.job(name) or {}).get("status") or {}

    def obj(self, resource: str, name: str) -> dict[str, Any] | None:
        return self.fake.stored(resource, NS, name)

    def workload(self, job: str, component: str) -> dict[str, Any]:
        res = "apps/v1/statefulsets" if component == "trainer" else "apps/v1/deployments"
        found = self.obj(res, f"{job}-{component}")
        assert found is not None, f"{res} {job}-{component} missing"
        return found

    def children(self, job: str) -> dict[str, dict[str, Any]]:
        out = {}
        for res in ("v1/configmaps", "v1/services", "v1/persistentvolumeclaims", *WORKLOADS):
            for name in self.fake.names(res, NS):
                if name.startswith(f"{job}-"):
                    out[f"{res}/{name}"] = self.obj(res, name)
        return out

    def events(self, job: str) -> list[tuple[str, str, str]]:
        return [(e.get("type"), e.get("reason"), e.get("message", ""))
                for e in self.fake.events(NS, job)]

    def condition(self, job: str, type_: str) -> dict[str, Any]:
        return next((c for c in self.status(job).get("conditions", []) if c["type"] == type_), {})

    def serve_trainer_status(self, job: str) -> tuple[health.HealthServicer, "_TrainerStatus"]:
        """A stand-in for the trainer's endpoints the operator reads (health, GetTrainerStatus);
        a real trainer needs a model, which this test is not about."""
        pool = futures.ThreadPoolExecutor(max_workers=2)
        server = grpc.server(pool)
        servicer = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
        status = _TrainerStatus()
        trainer_pb2_grpc.add_TrainerServicer_to_server(status, server)
        # With the certificate the operator issued for the job's trainer, as its pod mounts it.
        bundle = read_bundle(self.tls_dir(job, "trainer"))
        server.add_secure_port(f"unix:{self.sockets}/{job}-trainer.sock", server_credentials(bundle))
        server.start()
        self._cleanup.append(lambda: (server.stop(0).wait(), pool.shutdown(wait=True)))
        return servicer, status

    def tls_dir(self, job: str, component: str) -> Path:
        """The job's `component` certificate folder, from the Secret the operator made (what
        the component's pod mounts at /etc/kiln/tls)."""
        secret = wait_for(f"{job}-{component}-tls", lambda: self.obj("v1/secrets", f"{job}-{component}-tls"))
        if not hasattr(self, "_tls_root"):
            self._tls_root = Path(tempfile.mkdtemp(prefix="kiln-e2e-tls-"))
            self._cleanup.append(lambda: shutil.rmtree(self._tls_root, ignore_errors=True))
        folder = self._tls_root / job / component
        folder.mkdir(parents=True, exist_ok=True)
        for key, value in secret["data"].items():
            (folder / key).write_bytes(base64.b64decode(value))
        return folder

    def start_buffer(self, job: str, spec: dict[str, Any], run_dir: Path) -> str:
        job_file = run_dir / "job.yaml"
        job_file.write_text(yaml.safe_dump(manifest(job, **spec)))
        address = f"unix:{self.sockets}/{job}-buffer.sock"
        proc = subprocess.Popen(
            [sys.executable, "-m", "kiln.services.buffer.main", "--job", str(job_file),
             "--address", address, "--metrics-port", "0", "--run-dir", str(run_dir),
             "--tls-dir", str(self.tls_dir(job, "buffer"))],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

        def stop() -> None:
            proc.terminate()
            proc.wait(10)
        self._cleanup.append(stop)
        return address

    def close(self) -> None:
        for fn in reversed(self._cleanup):
            fn()


class _TrainerStatus(trainer_pb2_grpc.TrainerServicer):
    """GetTrainerStatus of a trainer at `policy_version`, in stage "sft"; RunStage (the
    operator's stage driver sends it) is accepted and changes nothing. No rollout answers, so
    the driver keeps waiting for it: these tests are about children and status; a job driven to
    the end is test_dev_cluster's."""

    policy_version = 0

    def GetTrainerStatus(self, request, context):  # noqa: N802 - gRPC method name
        return trainer_pb2.TrainerStatus(policy_version=self.policy_version, stage="sft")

    def RunStage(self, request, context):  # noqa: N802 - gRPC method name
        return self.GetTrainerStatus(request, context)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    import kopf
    import kubernetes
    from kopf.testing import KopfRunner

    tmp = tmp_path_factory.mktemp("operator-e2e")
    sockets = Path("/tmp") / f"kiln-e2e-{os.getpid()}"  # unix socket paths must stay short
    sockets.mkdir(exist_ok=True)
    settings = {
        "KILN_OPERATOR_STATUS_INTERVAL": "0.3",
        "KILN_OPERATOR_GRPC_TIMEOUT": "0.5",
        # Nothing runs the pods here; what the admin allows is test_operator_process's.
        "KILN_OPERATOR_ALLOW_PRIVILEGED_SANDBOXES": "true",
        "KILN_OPERATOR_ADDRESS_TEMPLATE": f"unix:{sockets}/{{name}}-{{component}}.sock",
    }
    saved = {k: os.environ.get(k) for k in [*settings, "KUBECONFIG"]}
    with running_fake_api() as (fake, url):
        fake.add_namespace(NS)
        kubeconfig = write_kubeconfig(tmp / "kubeconfig", url, NS)
        os.environ.update(settings, KUBECONFIG=str(kubeconfig))
        api_client = kubernetes.config.new_client_from_config(str(kubeconfig))
        c = Cluster(fake, kubernetes.client.CustomObjectsApi(api_client), sockets)
        args = ["run", "--standalone", "--namespace", NS, "-m", "kiln.operator.handlers"]
        kopf_settings = kopf.OperatorSettings()  # kept, to shut its handlers' threads down after
        try:
            with KopfRunner(args, timeout=30, settings=kopf_settings) as runner:
                yield c
                _stop_driving(c)
        finally:
            kopf_settings.execution.executor.shutdown(wait=True)
            c.close()
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
            for sock in sockets.glob("*.sock"):
                sock.unlink()
            sockets.rmdir()
    assert runner.exception is None, runner.output[-3000:]


def _stop_driving(c: Cluster) -> None:
    """Delete every job while the operator still runs, and wait for each job's driving thread
    to end: a thread still driving when the operator's event loop closes would post to a
    closed loop ("Event loop is closed") and outlive the tests."""
    for name in c.fake.names(RLJOBS, NS):
        c.delete(name)
    wait_for("every RLJob gone", lambda: not c.fake.names(RLJOBS, NS), timeout=120)
    wait_for("driving threads ended", lambda: not [
        t for t in threading.enumerate() if t.name.startswith(f"drive {NS}/")], timeout=120)


def _hashes(c: Cluster, job: str) -> dict[str, str]:
    return {comp: c.workload(job, comp)["spec"]["template"]["metadata"]["annotations"]
            ["kiln.dev/config-hash"] for comp in ("trainer", "rollout", "sandbox",
                                                  "weight-sync", "buffer")}


def test_create_applies_owned_children_and_status_follows_services(cluster: Cluster,
                                                                  tmp_path: Path) -> None:
    c = cluster
    c.create(manifest("alpha"))
    kids = wait_for("13 children", lambda: len(c.children("alpha")) == 13 and c.children("alpha"))
    uid = c.job("alpha")["metadata"]["uid"]
    for key, obj in kids.items():
        refs = obj["metadata"].get("ownerReferences", [])
        assert [r["uid"] for r in refs] == [uid], key
        assert refs[0]["kind"] == "RLJob" and refs[0]["controller"] is True
        assert obj["metadata"]["labels"]["app.kubernetes.io/instance"] == "alpha"
    job_file = yaml.safe_load(c.obj("v1/configmaps", "alpha-config")["data"]["job.yaml"])
    assert job_file["spec"]["stages"][0]["rl"]["tau"] == 2
    assert job_file["spec"]["sandbox"]["backend"] == "bubblewrap"  # defaults resolved
    wait_for("phase Pending", lambda: c.status("alpha").get("phase") == "Pending")
    assert c.condition("alpha", "Valid")["status"] == "True"
    assert c.job("alpha")["metadata"]["finalizers"] == ["kiln.dev/pvc-retention"]

    # Nothing answers yet: Pending, and Ready says why.
    ready = wait_for("Ready=False", lambda: c.condition("alpha", "Ready").get("status") == "False"
                     and c.condition("alpha", "Ready"))
    assert "alpha-trainer.sock" in ready["message"]

    # A real buffer process and the trainer's status endpoints come up: Running, with the
    # policy version the trainer reports.
    trainer, trainer_status = c.serve_trainer_status("alpha")
    trainer.set("", health_pb2.HealthCheckResponse.SERVING)
    trainer_status.policy_version = 7
    address = c.start_buffer("alpha", {}, tmp_path)
    channel = tls_channel(address, "buffer", bundle=read_bundle(c.tls_dir("alpha", "buffer")))
    grpc.channel_ready_future(channel).result(timeout=20)
    wait_for("Running with version 7", lambda: c.status("alpha").get("phase") == "Running"
             and c.status("alpha").get("policyVersion") == 7, timeout=20)
    assert c.condition("alpha", "Ready")["status"] == "True"
    reasons = [(t, r) for t, r, _ in c.events("alpha")]
    assert ("Normal", "Pending") in reasons and ("Normal", "Running") in reasons

    # The trainer goes away: the job stays Running, Ready turns False.
    trainer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    wait_for("Ready=False again", lambda: c.condition("alpha", "Ready").get("status") == "False")
    assert c.status("alpha")["phase"] == "Running"
    channel.close()


def test_scaling_rollout_is_live_and_spec_change_restarts_only_affected(cluster: Cluster) -> None:
    c = cluster
    c.create(manifest("beta"))
    wait_for("children", lambda: len(c.children("beta")) == 13)
    before = _hashes(c, "beta")
    trainer_rv = c.workload("beta", "trainer")["metadata"]["resourceVersion"]

    c.patch_spec("beta", {"rollout": {"replicas": 3}})
    wait_for("3 rollout replicas", lambda: c.workload("beta", "rollout")["spec"]["replicas"] == 3)
    assert _hashes(c, "beta") == before  # no pod restarts anywhere
    assert c.workload("beta", "trainer")["metadata"]["resourceVersion"] == trainer_rv

    c.patch_spec("beta", {"sandbox": {"timeoutSeconds": 7}})
    wait_for("sandbox restarted", lambda: _hashes(c, "beta")["sandbox"] != before["sandbox"])
    after = _hashes(c, "beta")
    assert {k for k in after if after[k] != before[k]} == {"sandbox"}
    cm = yaml.safe_load(c.obj("v1/configmaps", "beta-config")["data"]["job.yaml"])
    assert cm["spec"]["sandbox"]["timeoutSeconds"] == 7
    assert c.workload("beta", "rollout")["spec"]["replicas"] == 3


def test_an_autoscaling_decision_resizes_rollout_and_the_scale_status_follows(cluster: Cluster) -> None:
    """What the driver does with a decision on a cluster (`SpecReplicas.scale`): the RLJob's
    spec.rollout.replicas changes, the update handler resizes the Deployment without
    restarting a pod, and status carries what the scale subresource reads back."""
    import kubernetes

    from kiln.operator.driving import SpecReplicas
    from kiln.operator.kube import Kube

    c = cluster
    c.create(manifest("kappa", rollout={"replicas": 1, "autoscale": {"minReplicas": 1,
                                                                     "maxReplicas": 4}}))
    wait_for("children", lambda: len(c.children("kappa")) == 13)
    wait_for("scale status", lambda: c.status("kappa").get("rolloutReplicas") == 1)
    assert c.status("kappa")["rolloutSelector"] == (
        "app.kubernetes.io/name=kiln,app.kubernetes.io/instance=kappa,"
        "app.kubernetes.io/component=rollout")
    before = _hashes(c, "kappa")
    kube = Kube(kubernetes.config.new_client_from_config(os.environ["KUBECONFIG"]))
    ref = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "RLJob",
           "metadata": {"name": "kappa", "namespace": NS}}
    scaler = SpecReplicas(kube, ref, lambda: c.job("kappa")["spec"]["rollout"]["replicas"],
                          serving=lambda: 1)
    assert scaler.settled()
    scaler.scale(3)
    wait_for("3 rollout replicas", lambda: c.workload("kappa", "rollout")["spec"]["replicas"] == 3)
    assert scaler.replicas() == 3
    assert not scaler.settled()  # until three pods serve
    wait_for("scale status 3", lambda: c.status("kappa").get("rolloutReplicas") == 3)
    assert _hashes(c, "kappa") == before


def test_immutable_field_change_is_refused_until_reverted(cluster: Cluster) -> None:
    c = cluster
    c.create(manifest("gamma"))
    wait_for("Pending", lambda: c.status("gamma").get("phase") == "Pending")
    c.patch_spec("gamma", {"trainer": {"tensorParallel": 2}})
    valid = wait_for("refusal", lambda: c.condition("gamma", "Valid").get("status") == "False"
                     and c.condition("gamma", "Valid"))
    assert valid["reason"] == "ImmutableFieldChanged"
    assert "spec.trainer.tensorParallel" in valid["message"]
    assert "spec.trainer.tensorParallel" in c.status("gamma")["message"]
    assert any(t == "Warning" and r == "ImmutableFieldChanged" for t, r, _ in c.events("gamma"))
    cm = yaml.safe_load(c.obj("v1/configmaps", "gamma-config")["data"]["job.yaml"])
    assert cm["spec"]["trainer"]["tensorParallel"] == 1  # children keep the accepted spec

    c.patch_spec("gamma", {"trainer": {"tensorParallel": 1}})
    wait_for("accepted again", lambda: c.condition("gamma", "Valid").get("status") == "True")
    assert "spec.trainer.tensorParallel" not in c.status("gamma")["message"]


def test_delete_applies_pvc_retention(cluster: Cluster) -> None:
    c = cluster
    c.create(manifest("eps", buffer={"storage": {"retain": False}},
                      checkpoints={"storage": {"retain": True, "size": "1Gi"}}))
    wait_for("children", lambda: len(c.children("eps")) == 13)
    c.delete("eps")
    wait_for("RLJob gone", lambda: c.job("eps") is None)
    assert c.obj("v1/persistentvolumeclaims", "eps-buffer") is None
    kept = c.obj("v1/persistentvolumeclaims", "eps-checkpoints")
    assert kept is not None
    assert "ownerReferences" not in kept["metadata"]
    assert kept["metadata"]["labels"]["kiln.dev/retained-from"] == "eps"
    # Everything else carries an owner reference; a real cluster's garbage collector removes it.
    owned = [o for o in c.children("eps").values() if o["metadata"].get("ownerReferences")]
    assert len(owned) == 11

    # A new RLJob of the same name does not take over the retained volume (another uid).
    c.create(manifest("eps", buffer={"storage": {"retain": False}},
                      checkpoints={"storage": {"retain": True, "size": "1Gi"}}))
    wait_for("Failed", lambda: c.status("eps").get("phase") == "Failed")
    valid = c.condition("eps", "Valid")
    assert valid["reason"] == "PVCNotAdopted" and "eps-checkpoints" in valid["message"]
    assert wait_for("warning event", lambda: [m for t, r, m in c.events("eps")
                                              if t == "Warning" and r == "PVCNotAdopted"])


def test_bad_spec_is_refused_with_reason_and_event(cluster: Cluster) -> None:
    c = cluster
    bad = manifest("zeta")
    bad["spec"]["stages"][0]["tasks"] = ["nope"]
    bad["spec"]["rollout"]["replicas"] = -1
    c.create(bad)
    wait_for("Failed", lambda: c.status("zeta").get("phase") == "Failed")
    valid = c.condition("zeta", "Valid")
    assert valid["status"] == "False" and valid["reason"] == "InvalidSpec"
    assert "spec.rollout.replicas" in valid["message"]
    assert "spec.rollout.replicas" in c.status("zeta")["message"]
    warnings = wait_for("warning event", lambda: [m for t, r, m in c.events("zeta")
                                                  if t == "Warning" and r == "InvalidSpec"])
    assert "spec.rollout.replicas" in warnings[0]
    assert c.children("zeta") == {}

    # Fixing the spec makes it a normal job.
    c.patch_spec("zeta", {"rollout": {"replicas": 1},
                          "stages": BASE_SPEC["stages"]})
    wait_for("accepted", lambda: c.status("zeta").get("phase") == "Pending")
    assert len(c.children("zeta")) == 13

