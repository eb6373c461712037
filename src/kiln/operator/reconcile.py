"""Bring a cluster to an RLJob's desired children, and apply its PVC retention on deletion.

`parse_spec` validates a spec with the same pydantic models `kiln validate` uses and returns
readable reasons; `reconcile` refuses changes to immutable fields (the accepted spec is the one
in the job's ConfigMap, so the rule survives operator restarts), then applies every child in
order; `finalize` keeps or deletes the checkpoints and buffer PVCs per `spec.*.storage.retain`
(a kept PVC loses its owner reference, so garbage collection leaves it alone).

Not covered: status and events (`kiln.operator.handlers`), the manifests (`children`).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import yaml
from pydantic import ValidationError

from kiln.api.images import from_registry
from kiln.api.spec import API_GROUP, API_VERSION, KIND, RLJobSpec
from kiln.api.validate import validate_document
from kiln.operator import adoption, children, frozen, router
from kiln.operator.kube import Kube
from kiln.operator.naming import RETAINED_FROM, JobRef
from kiln.operator.tls import ensure_certificates
from kiln.operator.workloads import SandboxHosting

log = logging.getLogger("kiln.operator")


def parse_spec(name: str, spec: dict[str, Any],
               image_registry: str | None = None) -> tuple[RLJobSpec | None, list[str]]:
    """The validated spec, or None and one "field: reason" line per problem. Kiln's default
    image is taken from `image_registry` (the chart's `image.registry`, `kiln.api.images`)."""
    document = {"apiVersion": f"{API_GROUP}/{API_VERSION}", "kind": KIND,
                "metadata": {"name": name}, "spec": spec}
    job, problems = validate_document(document, file=name)
    if job is None:
        return None, [f"{p.path}: {p.message}" if p.path else p.message for p in problems]
    return from_registry(job.spec, image_registry), []


@dataclass
class Result:
    actions: dict[str, str] = field(default_factory=dict)
    """"Kind/name" -> created, updated or unchanged."""
    refused: list[str] = field(default_factory=list)
    """Why nothing was applied (immutable fields changed)."""
    not_adopted: list[str] = field(default_factory=list)
    """Why nothing was applied (existing PVCs another job created, `adoption.py`)."""


def accepted_spec(kube: Kube, job: JobRef) -> RLJobSpec | None:
    """The spec the running children were made from (the job file in the ConfigMap)."""
    cm = kube.get("v1", "ConfigMap", job.namespace, job.child("config"))
    if cm is None:
        return None
    text = (cm.get("data") or {}).get(children.JOB_FILE_KEY)
    if not text:
        return None
    try:
        return RLJobSpec.model_validate(yaml.safe_load(text)["spec"])
    except (ValidationError, KeyError, TypeError, yaml.YAMLError) as exc:
        # The operator wrote this file; an unreadable one means someone edited it by hand.
        log.warning("ConfigMap %s/%s holds no valid job file (%s); treating the job as new",
                    job.namespace, job.child("config"), exc)
        return None


def reconcile(kube: Kube, job: JobRef, spec: RLJobSpec, *,
              hosting: SandboxHosting = SandboxHosting(), active: bool | None = None,
              finished_stages: list[str] = ()) -> Result:
    """`active`: whether the services run (default: unless suspended). `finished_stages` (the
    status's) decides which frozen deployments made by a stage can start."""
    result = Result()
    previous = accepted_spec(kube, job)
    if previous is not None:
        result.refused = children.immutable_changes(previous, spec)
        if result.refused:
            return result
    result.not_adopted = adoption.refusals(kube, job, spec)
    if result.not_adopted:
        return result
    # Certificates first: the pods mount them, and the CA is part of their config hash.
    ca = ensure_certificates(kube, job, spec.image)
    for manifest in children.desired_children(job, spec, active=not spec.suspend if active is None else active,
                                              hosting=hosting, ca_fingerprint=ca,
                                              finished_stages=finished_stages):
        key = f"{manifest['kind']}/{manifest['metadata']['name']}"
        result.actions[key] = kube.apply(manifest)
    # An edit that names fewer frozen checkpoints, or drops openaiPort, leaves deployments
    # nothing uses any more.
    gone = [*frozen.stale(job, previous, spec), *router.stale(job, previous, spec)] if previous else []
    for ref in gone:
        if kube.delete(ref):
            result.actions[f"{ref['kind']}/{ref['metadata']['name']}"] = "deleted"
    return result


def finalize(kube: Kube, job: JobRef, spec: RLJobSpec | None) -> dict[str, str]:
    """Apply the retention policy to the job's PVCs: name -> retained/deleted/absent."""
    # An invalid spec never created PVCs; with nothing to read, keep whatever exists (the safe
    # side of the default `retain: true`).
    retain = (children.retained_pvc_names(job, spec) if spec is not None
              else {job.child("checkpoints"): True, job.child("buffer"): True})
    out = {}
    for name, keep in retain.items():
        ref = {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
               "metadata": {"name": name, "namespace": job.namespace}}
        current = kube.get("v1", "PersistentVolumeClaim", job.namespace, name)
        if current is None:
            out[name] = "absent"
        elif keep:
            kube.merge_patch(ref, {"metadata": {"ownerReferences": None,
                                                "labels": {RETAINED_FROM: job.name}}})
            out[name] = "retained"
        else:
            kube.delete(ref)
            out[name] = "deleted"
    return out
