"""`kiln-operator` as a process: against the fake API server here, against a real cluster with
`--kube-config` (marked k8s).

The real-cluster test installs the CRD, runs the operator from this checkout against the
cluster, applies an RLJob and checks what `kubectl` shows. It refuses a kube context that is not
named like a throw-away test cluster (kind-*, test*).
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from kiln.cli.devcluster.api import running_fake_api, write_kubeconfig

ROOT = Path(__file__).resolve().parents[2]
OPERATOR = Path(sys.executable).parent / "kiln-operator"
KUBECTL = ROOT / ".tools" / "bin" / "kubectl"
JOB = {
    "apiVersion": "kiln.dev/v1alpha1", "kind": "RLJob", "metadata": {"name": "proc"},
    "spec": {"model": {"path": "m"}, "tasks": [{"name": "t", "env": "chain", "generate": {"count": 4}}],
             "stages": [{"name": "rl", "type": "rl", "tasks": ["t"], "batchSize": 8,
                         "microBatchSize": 8, "rl": {"groupSize": 8}}],
             "buffer": {"storage": {"size": "1Gi", "retain": False}},
             "checkpoints": {"storage": {"size": "1Gi", "retain": False}}},
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(what: str, check: Callable[[], Any], timeout: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status, resp.read().decode()
    except OSError:
        return 0, ""


def _start_operator(kubeconfig: Path, namespace: str,
                    **settings: str) -> tuple[subprocess.Popen, int, int]:
    health, metrics = _free_port(), _free_port()
    env = {**os.environ, "KUBECONFIG": str(kubeconfig), "KILN_OPERATOR_STATUS_INTERVAL": "1",
           **{f"KILN_OPERATOR_{k.upper()}": v for k, v in settings.items()}}
    proc = subprocess.Popen(
        [str(OPERATOR), "--namespace", namespace, "--liveness",
         f"http://127.0.0.1:{health}/healthz", "--metrics-port", str(metrics)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return proc, health, metrics


def _stop(proc: subprocess.Popen) -> str:
    proc.send_signal(signal.SIGTERM)
    try:
        out, _ = proc.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
    return out


def test_operator_process_serves_liveness_metrics_and_reconciles(tmp_path: Path) -> None:
    import kubernetes

    with running_fake_api() as (fake, url):
        fake.add_namespace("proc-ns")
        kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", url, "proc-ns")
        proc, health, metrics = _start_operator(kubeconfig, "proc-ns", sandbox_runtime_class="kata")
        try:
            wait_for("liveness endpoint", lambda: _get(f"http://127.0.0.1:{health}/healthz")[0] == 200)
            api = kubernetes.client.CustomObjectsApi(kubernetes.config.new_client_from_config(str(kubeconfig)))
            api.create_namespaced_custom_object("kiln.dev", "v1alpha1", "proc-ns", "rljobs", JOB)
            wait_for("ConfigMap", lambda: fake.stored("v1/configmaps", "proc-ns", "proc-config"))
            sandbox = wait_for("sandbox Deployment", lambda: fake.stored(
                "apps/v1/deployments", "proc-ns", "proc-sandbox"))
            assert sandbox["spec"]["template"]["spec"]["runtimeClassName"] == "kata"
            applied = 'kiln_operator_reconciles_total{result="applied"} 1.0'
            body = wait_for("reconcile metric", lambda: (
                lambda text: applied in text and text)(_get(f"http://127.0.0.1:{metrics}/metrics")[1]))
            assert 'kiln_operator_jobs{phase="Pending"} 1.0' in body
            status, probe = _get(f"http://127.0.0.1:{health}/healthz")
            # kopf caches probe results for a while; the probe's presence is what is checked.
            assert status == 200 and "jobs" in json.loads(probe)
        finally:
            out = _stop(proc)
        assert proc.returncode == 0, out[-3000:]
    # Its log (JSON, the default) is JSON lines throughout, kopf's own records included, each
    # naming the object it is about.
    records = [json.loads(line) for line in out.splitlines()]
    assert any(r.get("object") == "proc-ns/proc" and r["logger"].startswith("kopf")
               for r in records), out[-3000:]
    assert all(r["service"] == "operator" for r in records)


def test_sandboxes_are_refused_unless_the_admin_allows_them(tmp_path: Path) -> None:
    """An operator installed with the chart's defaults (no sandbox RuntimeClass, privileged
    sandboxes not allowed) refuses a job with sandboxes, applies nothing of it, and says what
    the admin can set; the same job without sandboxes is accepted."""
    import kubernetes

    with running_fake_api() as (fake, url):
        fake.add_namespace("deny-ns")
        kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", url, "deny-ns")
        proc, health, _metrics = _start_operator(kubeconfig, "deny-ns")
        try:
            wait_for("liveness endpoint", lambda: _get(f"http://127.0.0.1:{health}/healthz")[0] == 200)
            api = kubernetes.client.CustomObjectsApi(kubernetes.config.new_client_from_config(str(kubeconfig)))
            api.create_namespaced_custom_object("kiln.dev", "v1alpha1", "deny-ns", "rljobs", JOB)

            def status() -> dict:
                return api.get_namespaced_custom_object("kiln.dev", "v1alpha1", "deny-ns", "rljobs",
                                                        "proc").get("status") or {}
            wait_for("refusal", lambda: status().get("phase") == "Failed")
            valid = next(c for c in status()["conditions"] if c["type"] == "Valid")
            assert valid["reason"] == "NotAllowed"
            assert "sandboxRuntimeClass" in valid["message"] and "allowPrivilegedSandboxes" in valid["message"]
            assert not fake.stored("v1/configmaps", "deny-ns", "proc-config")
            api.patch_namespaced_custom_object("kiln.dev", "v1alpha1", "deny-ns", "rljobs", "proc",
                                               {"spec": {"sandbox": {"replicas": 0}}})
            wait_for("accepted", lambda: status().get("phase") == "Pending")
        finally:
            out = _stop(proc)
        assert proc.returncode == 0, out[-3000:]


def test_operator_refuses_to_start_without_a_namespace_choice() -> None:
    proc = subprocess.run([str(OPERATOR)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "--namespace" in proc.stderr and "--all-namespaces" in proc.stderr


# ------------------------------------------------------------------------------- real cluster


def _kubectl(kubeconfig: str, *args: str, check: bool = True) -> str:
    proc = subprocess.run([str(KUBECTL), "--kubeconfig", kubeconfig, *args], capture_output=True,
                          text=True, timeout=120)
    if check:
        assert proc.returncode == 0, f"kubectl {' '.join(args)}: {proc.stderr}"
    return proc.stdout


@pytest.mark.k8s
def test_real_cluster_create_status_delete(request: pytest.FixtureRequest) -> None:
    kubeconfig = request.config.getoption("--kube-config")
    context = _kubectl(kubeconfig, "config", "current-context").strip()
    if not (context.startswith("kind-") or context.startswith("test")):
        pytest.fail(f"refusing kube context {context!r}: only kind-* or test* contexts are used by tests")
    namespace = f"kiln-test-{uuid.uuid4().hex[:6]}"
    _kubectl(kubeconfig, "apply", "-f", str(ROOT / "charts" / "kiln" / "crds" / "rljobs.kiln.dev.yaml"))
    _kubectl(kubeconfig, "create", "namespace", namespace)
    # A kind cluster's node is a container of the test machine: privileged pods are its own.
    proc, _health, _metrics = _start_operator(Path(kubeconfig), namespace,
                                              allow_privileged_sandboxes="true")
    try:
        manifest = Path(request.config.cache.mkdir("kiln")) / "proc.yaml"
        manifest.write_text(yaml.safe_dump(JOB))
        _kubectl(kubeconfig, "-n", namespace, "apply", "-f", str(manifest))
        wait_for("phase Pending", lambda: _kubectl(
            kubeconfig, "-n", namespace, "get", "rljob", "proc", "-o", "jsonpath={.status.phase}") == "Pending", 60)
        deps = json.loads(_kubectl(kubeconfig, "-n", namespace, "get", "deployments", "-o", "json"))
        names = {d["metadata"]["name"] for d in deps["items"]}
        assert names == {"proc-rollout", "proc-sandbox", "proc-weight-sync", "proc-buffer"}
        assert all(d["metadata"]["ownerReferences"][0]["kind"] == "RLJob" for d in deps["items"])
        table = _kubectl(kubeconfig, "-n", namespace, "get", "rljobs")
        assert "proc" in table and "Pending" in table
        _kubectl(kubeconfig, "-n", namespace, "delete", "rljob", "proc", "--wait=true", "--timeout=60s")
        wait_for("PVCs deleted (retain: false)", lambda: _kubectl(
            kubeconfig, "-n", namespace, "get", "pvc", "-o", "name").strip() == "", 60)
    finally:
        _stop(proc)
        _kubectl(kubeconfig, "delete", "namespace", namespace, "--wait=false", check=False)
