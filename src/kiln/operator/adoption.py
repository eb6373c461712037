"""Which existing PersistentVolumeClaims an RLJob may take as its own.

A job's checkpoints and buffer PVCs (`<job>-checkpoints`, `<job>-buffer`) can outlive it
(`storage.retain`): deletion strips their owner reference. A later RLJob of the same name would
then mount them by name alone, and train from (or serve as its own) checkpoints another job
wrote, which a pickle-free loader still trusts as the job's own data. So each PVC records the
uid of the job that created it (annotation `kiln.dev/job-uid`, written with the PVC), and
`refusals` lets a job use an existing PVC only when that uid is its own; anything else is
refused with the reason and nothing of the job is applied.

Taking over a retained PVC on purpose is an explicit act of whoever may edit PVCs: set the
annotation to the new job's uid.

Not covered: PVCs the spec names itself (`model.pvc`), which are the author's to choose.
"""
from __future__ import annotations

from typing import Any

from kiln.api.spec import RLJobSpec
from kiln.operator import children
from kiln.operator.kube import Kube
from kiln.operator.naming import JOB_UID, RETAINED_FROM, JobRef


def recorded_uid(pvc: dict[str, Any]) -> str | None:
    """The uid of the job that created `pvc`: its annotation, else the RLJob owner reference
    of a PVC still owned (one made before the annotation was written); None if neither."""
    meta = pvc.get("metadata") or {}
    uid = (meta.get("annotations") or {}).get(JOB_UID)
    if uid:
        return uid
    owners = [o.get("uid") for o in meta.get("ownerReferences") or [] if o.get("kind") == "RLJob"]
    return owners[0] if owners else None


def refusals(kube: Kube, job: JobRef, spec: RLJobSpec) -> list[str]:
    """One "field: reason" line per existing PVC of the job's names that is not the job's."""
    out = []
    for name, field in zip(children.retained_pvc_names(job, spec), ("checkpoints", "buffer")):
        current = kube.get("v1", "PersistentVolumeClaim", job.namespace, name)
        if current is None:
            continue
        owner = recorded_uid(current)
        if owner == job.uid:
            continue
        labels = (current.get("metadata") or {}).get("labels") or {}
        origin = (f"of RLJob uid {owner}" if owner else "recording no job") + (
            f", retained from RLJob {labels[RETAINED_FROM]}" if RETAINED_FROM in labels else "")
        out.append(f"{field}.storage: PersistentVolumeClaim {job.namespace}/{name} exists "
                   f"({origin}), not this job's (uid {job.uid}); a job does not take over another "
                   f"job's volume. Delete or rename the PVC, rename the job, or set the PVC's "
                   f"annotation {JOB_UID}={job.uid} to adopt it on purpose")
    return out
