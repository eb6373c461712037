"""Kubernetes job conventions on a live RLJob: the real operator (kopf, in-process) against the
fake API server, as in test_operator_e2e (whose harness this reuses; no real API server can run
here). Kueue's part is played by flipping spec.suspend; the deadline, the TTL and managedBy are
the operator's own. The rules themselves are test_operator_lifecycle's."""
from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import pytest

from helpers.operator_runner import FakeCluster as Cluster
from helpers.operator_runner import running_operator, wait_for

NS = "kiln-conventions"
SPEC: dict[str, Any] = {
    "model": {"path": "models/tiny"},
    "tasks": [{"name": "train", "env": "chain", "generate": {"count": 16}}],
    "stages": [{"name": "rl", "type": "rl", "tasks": ["train"], "maxSteps": 4, "batchSize": 8,
                "microBatchSize": 8, "rl": {"groupSize": 8}}],
}


def manifest(name: str, **spec_changes: Any) -> dict[str, Any]:
    return {"apiVersion": "kiln.dev/v1alpha1", "kind": "RLJob", "metadata": {"name": name},
            "spec": {**copy.deepcopy(SPEC), **spec_changes}}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with running_operator(tmp_path_factory.mktemp("conventions"), NS) as c:
        yield c


def test_suspend_scales_to_zero_and_back_keeping_volumes(cluster: Cluster) -> None:
    c = cluster
    c.create(manifest("delta", rollout={"replicas": 2}))
    wait_for("children", lambda: len(c.children("delta")) == 13)
    c.patch_spec("delta", {"suspend": True})
    wait_for("Suspended", lambda: c.status("delta").get("phase") == "Suspended")
    for comp in ("trainer", "rollout", "sandbox", "weight-sync", "buffer"):
        assert c.workload("delta", comp)["spec"]["replicas"] == 0, comp
    assert c.obj("v1/persistentvolumeclaims", "delta-checkpoints") is not None
    assert c.obj("v1/persistentvolumeclaims", "delta-buffer") is not None

    c.patch_spec("delta", {"suspend": False})
    wait_for("resumed", lambda: c.status("delta").get("phase") == "Pending")
    assert c.workload("delta", "rollout")["spec"]["replicas"] == 2
    assert c.workload("delta", "trainer")["spec"]["replicas"] == 1
    reasons = [r for _, r, _ in c.events("delta")]
    assert "Suspended" in reasons


def test_kueue_admits_and_preempts_through_suspend(cluster: Cluster) -> None:
    """Plays Kueue's part: the job is created suspended with its queue label, admitted by
    clearing spec.suspend, and preempted by setting it again."""
    c = cluster
    body = manifest("queued", suspend=True)
    body["metadata"]["labels"] = {"kueue.x-k8s.io/queue-name": "team-queue"}
    c.create(body)
    wait_for("Suspended", lambda: c.status("queued").get("phase") == "Suspended")
    assert set(c.replicas("queued").values()) == {0}  # no pod before admission
    assert "startTime" not in c.status("queued")
    ready = c.condition("queued", "Ready")
    assert ready["reason"] == "Suspended"
    assert ready["observedGeneration"] == c.job("queued")["metadata"]["generation"]

    c.patch_spec("queued", {"suspend": False})  # admitted
    wait_for("Pending", lambda: c.status("queued").get("phase") == "Pending")
    started = c.status("queued")["startTime"]
    assert c.workload("queued", "trainer")["spec"]["replicas"] == 1
    assert c.job("queued")["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-queue"
    template = c.workload("queued", "rollout")["spec"]["template"]["metadata"]["labels"]
    assert "kueue.x-k8s.io/queue-name" not in template  # Kueue admits the RLJob, not its pods

    c.patch_spec("queued", {"suspend": True})  # preempted
    wait_for("Suspended again", lambda: c.status("queued").get("phase") == "Suspended")
    assert c.workload("queued", "trainer")["spec"]["replicas"] == 0
    assert c.status("queued")["startTime"] == started


def test_active_deadline_fails_the_job_and_stops_its_pods(cluster: Cluster) -> None:
    c = cluster
    c.create(manifest("late", activeDeadlineSeconds=1))
    wait_for("Failed", lambda: c.status("late").get("phase") == "Failed")
    driving = c.condition("late", "Driving")
    assert driving["status"] == "False" and driving["reason"] == "DeadlineExceeded"
    status = c.status("late")
    assert status["startTime"] <= status["completionTime"]
    assert "activeDeadlineSeconds" in status["message"]
    wait_for("pods stopped", lambda: set(c.replicas("late").values()) == {0})
    wait_for("the Warning event", lambda: any(
        t == "Warning" and r == "DeadlineExceeded" for t, r, _ in c.events("late")))
    assert c.obj("v1/persistentvolumeclaims", "late-checkpoints") is not None

    # An edit (a longer deadline) starts it again, on a new clock.
    c.patch_spec("late", {"activeDeadlineSeconds": 3600})
    wait_for("Pending again", lambda: c.status("late").get("phase") == "Pending")
    assert "completionTime" not in c.status("late")
    assert c.status("late")["startTime"] >= status["completionTime"]
    assert c.workload("late", "trainer")["spec"]["replicas"] == 1


@pytest.mark.slow  # up to a minute: the finalizer waits for the job's driver to stop
def test_ttl_deletes_the_finished_job(cluster: Cluster) -> None:
    c = cluster
    c.create(manifest("brief", activeDeadlineSeconds=1, ttlSecondsAfterFinished=1))
    wait_for("Failed", lambda: c.status("brief").get("phase") == "Failed")
    # kopf releases the finalizer once the job's driver daemon has stopped, which it does
    # between two polls of the (absent) services: seconds, or tens of them on a loaded machine.
    wait_for("RLJob deleted after its TTL", lambda: c.job("brief") is None, timeout=120)
    # The finalizer ran: the checkpoints (retain: true by default) outlive the job.
    kept = c.obj("v1/persistentvolumeclaims", "brief-checkpoints")
    assert kept is not None and kept["metadata"]["labels"]["kiln.dev/retained-from"] == "brief"


def test_a_job_managed_by_another_controller_is_left_alone(cluster: Cluster) -> None:
    c = cluster
    c.create(manifest("remote", managedBy="kueue.x-k8s.io/multikueue"))
    c.create(manifest("local"))
    # Handled in turn: once the later job is reconciled, the first one would have been.
    wait_for("local Pending", lambda: c.status("local").get("phase") == "Pending")
    remote = c.job("remote")
    assert "status" not in remote or not remote["status"]
    assert not remote["metadata"].get("finalizers")
    assert c.children("remote") == {}
