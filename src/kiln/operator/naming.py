"""Names, labels, owner references and hashes shared by every child of an RLJob.

A child's name is `<job>-<component>`; its labels are the recommended `app.kubernetes.io/*`
set plus `kiln.dev/job`, and the selector of a workload uses only the labels that never change
(name, instance, component). Everything here is a pure function of its arguments.

Not covered: the manifests themselves (`kiln.operator.children`, `kiln.operator.workloads`).
"""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any

from kiln.api.ports import GRPC_PORT, METRICS_PORT  # noqa: F401 (the operator's names for them)
from kiln.api.spec import API_GROUP, API_VERSION, KIND

COMPONENTS = ("trainer", "rollout", "sandbox", "weight-sync", "buffer")
"""The five services of a job, in the order they are applied (the trainer's Service first)."""

JOB_FILE = "/etc/kiln/job.yaml"
RUN_DIR = "/var/lib/kiln"
MODEL_ROOT = "/models"
MANAGER = "kiln-operator"

JOB_LABEL = f"{API_GROUP}/job"
CONFIG_HASH = f"{API_GROUP}/config-hash"
RETAINED_FROM = f"{API_GROUP}/retained-from"
JOB_UID = f"{API_GROUP}/job-uid"
"""Annotation of a job's PVCs: the uid of the RLJob that created them (`adoption.py`)."""
FINALIZER = f"{API_GROUP}/pvc-retention"


@dataclass(frozen=True)
class JobRef:
    """The identity of one RLJob object: what every child needs to point back at it."""

    name: str
    namespace: str
    uid: str

    def child(self, component: str) -> str:
        return f"{self.name}-{component}"


def owner_reference(job: JobRef) -> dict[str, Any]:
    return {
        "apiVersion": f"{API_GROUP}/{API_VERSION}",
        "kind": KIND,
        "name": job.name,
        "uid": job.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _label_value(text: str) -> str:
    """A string cut down to what a label value allows (63 chars of [A-Za-z0-9._-])."""
    value = re.sub(r"[^A-Za-z0-9._-]", "-", text)[:63]
    return value.strip("-._")


def image_version(image: str) -> str:
    """The tag of an image reference (`repo:tag` or `repo@sha256:...`), for the version label."""
    ref = image.rsplit("/", 1)[-1]
    if "@" in ref:
        return _label_value(ref.split("@", 1)[1].replace(":", "-"))[:20]
    if ":" in ref:
        return _label_value(ref.split(":", 1)[1])
    return "latest"


def selector_labels(job: JobRef, component: str) -> dict[str, str]:
    """Labels a workload selects its pods by; they must never change for the life of the job."""
    return {
        "app.kubernetes.io/name": "kiln",
        "app.kubernetes.io/instance": job.name,
        "app.kubernetes.io/component": component,
    }


def labels(job: JobRef, component: str, image: str) -> dict[str, str]:
    return {
        **selector_labels(job, component),
        "app.kubernetes.io/part-of": "kiln",
        "app.kubernetes.io/managed-by": MANAGER,
        "app.kubernetes.io/version": image_version(image),
        JOB_LABEL: job.name,
    }


def metadata(job: JobRef, component: str, image: str, name: str | None = None) -> dict[str, Any]:
    return {
        "name": name or job.child(component),
        "namespace": job.namespace,
        "labels": labels(job, component, image),
        "ownerReferences": [owner_reference(job)],
    }


def config_hash(parts: dict[str, Any]) -> str:
    """A short stable digest of JSON-serialisable settings (key order does not matter)."""
    text = json.dumps(parts, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def component_address(job: JobRef, component: str) -> str:
    """In-cluster gRPC address of a component's Service, as the services' env vars give it."""
    return f"{job.child(component)}:{GRPC_PORT}"


def addr_env_name(component: str) -> str:
    return f"KILN_{component.upper().replace('-', '_')}_ADDR"
