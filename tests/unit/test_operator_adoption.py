"""A retained PVC is taken over by a new RLJob only when it records that job's uid: the
operator's `reconcile` against the fake Kubernetes API (no API server can run here; the
operator's client and the reconciler are real)."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import kubernetes

from kiln.cli.devcluster.api import running_fake_api, write_kubeconfig
from kiln.operator.kube import Kube
from kiln.operator.naming import JOB_UID
from kiln.operator.reconcile import finalize, reconcile
from helpers.operator_jobs import JOB, SMALL, spec

PVC = ("v1", "PersistentVolumeClaim")


def test_a_retained_pvc_is_adopted_only_by_the_job_whose_uid_it_records(tmp_path: Path) -> None:
    job_spec = spec(SMALL)
    with running_fake_api() as (fake, url):
        fake.add_namespace(JOB.namespace)
        kube = Kube(kubernetes.config.new_client_from_config(
            str(write_kubeconfig(tmp_path / "kubeconfig", url, JOB.namespace))))
        first = reconcile(kube, JOB, job_spec)
        assert not first.not_adopted and first.actions["PersistentVolumeClaim/demo-checkpoints"] == "created"
        pvc = kube.get(*PVC, JOB.namespace, "demo-checkpoints")
        assert pvc["metadata"]["annotations"][JOB_UID] == JOB.uid
        assert reconcile(kube, JOB, job_spec).not_adopted == []  # its own PVCs, again

        # The job is deleted with its volumes retained; a new job of the same name comes.
        assert finalize(kube, JOB, job_spec)["demo-checkpoints"] == "retained"
        successor = dataclasses.replace(JOB, uid="99999999-aaaa-bbbb-cccc-dddddddddddd")
        refused = reconcile(kube, successor, job_spec)
        assert refused.actions == {}  # nothing of the new job is applied
        assert [line.split(":")[0] for line in refused.not_adopted] == ["checkpoints.storage",
                                                                         "buffer.storage"]
        reason = refused.not_adopted[0]
        assert "demo-checkpoints" in reason and JOB.uid in reason and successor.uid in reason

        # A PVC that records no job at all is not adopted either.
        kube.merge_patch({"apiVersion": "v1", "kind": "PersistentVolumeClaim",
                          "metadata": {"name": "demo-buffer", "namespace": JOB.namespace}},
                         {"metadata": {"annotations": {JOB_UID: None}}})
        assert "recording no job" in reconcile(kube, successor, job_spec).not_adopted[1]

        # Adopting on purpose: whoever may edit PVCs records the new job's uid on both.
        for name in ("demo-checkpoints", "demo-buffer"):
            kube.merge_patch({"apiVersion": "v1", "kind": "PersistentVolumeClaim",
                              "metadata": {"name": name, "namespace": JOB.namespace}},
                             {"metadata": {"annotations": {JOB_UID: successor.uid}}})
        adopted = reconcile(kube, successor, job_spec)
        assert adopted.not_adopted == [] and adopted.actions
