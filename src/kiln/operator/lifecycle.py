"""The Kubernetes job conventions of an RLJob, as pure functions of its spec and status.

Kubernetes' own Job, Kubeflow's TrainJob and KubeRay's RayJob share a few rules that queues,
dashboards and cleanup tools rely on; an RLJob follows them:

- `status.startTime` is set when the job's pods are first asked for, and again when a suspended
  or failed job starts again; `status.completionTime` when it ends, Succeeded or Failed (a
  spec refused by validation does not end it: editing the spec is the fix);
- `spec.activeDeadlineSeconds`, counted from startTime: past it the job fails with reason
  `DeadlineExceeded` and its pods are stopped;
- `spec.ttlSecondsAfterFinished`, counted from completionTime: then the RLJob is deleted;
- `spec.managedBy`: a job that names another controller (MultiKueue dispatching it to a worker
  cluster, say) is left alone, unreconciled, undriven, without a finalizer;
- `spec.suspend` is the admission gate of a queue (Kueue creates the job suspended and clears
  suspend when it admits it): a suspended job has no running pod, and startTime waits for the
  resume.

Not covered: writing any of it to the cluster (`kiln.operator.handlers`, `driving`).
"""
from __future__ import annotations

from datetime import datetime
from typing import Any

from kiln.api.spec import MANAGED_BY

ACTIVE = ("Pending", "Running")
"""Phases whose pods run (or are being started)."""
FINISHED = ("Succeeded", "Failed")
DEADLINE_EXCEEDED = "DeadlineExceeded"
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
"""Kueue's label on the RLJob naming the LocalQueue that admits it (read by Kueue alone: the
pods do not carry it, so that Kueue's pod integration does not gate them a second time)."""


def ours(spec: dict[str, Any]) -> bool:
    """Whether Kiln's operator runs a job (`spec.managedBy` unset or naming it)."""
    return spec.get("managedBy") in (None, MANAGED_BY)


def unix(rfc3339: str) -> float:
    return datetime.fromisoformat(rfc3339.replace("Z", "+00:00")).timestamp()


def times(previous: dict[str, Any], phase: str, now: str) -> dict[str, Any]:
    """startTime and completionTime after the job goes from `previous["phase"]` to `phase`
    (None: the field is cleared)."""
    old = previous.get("phase")
    start, done = previous.get("startTime"), previous.get("completionTime")
    if phase in ACTIVE and old not in ACTIVE:
        start, done = now, None  # first start, a resume, or a restart after an edit
    elif phase in FINISHED and old not in FINISHED:
        done = now
    return {"startTime": start, "completionTime": done}


def deadline_exceeded(spec: dict[str, Any], status: dict[str, Any], now: float) -> bool:
    """The job runs, and longer than `spec.activeDeadlineSeconds` since its startTime."""
    deadline = spec.get("activeDeadlineSeconds")
    start = status.get("startTime")
    return (deadline is not None and start is not None and status.get("phase") in ACTIVE
            and now - unix(start) >= deadline)


def expired(spec: dict[str, Any], status: dict[str, Any], now: float) -> bool:
    """The job finished `spec.ttlSecondsAfterFinished` or more seconds ago."""
    ttl = spec.get("ttlSecondsAfterFinished")
    done = status.get("completionTime")
    return (ttl is not None and done is not None and status.get("phase") in FINISHED
            and now - unix(done) >= ttl)


def deadline_message(spec: dict[str, Any]) -> str:
    return (f"the job ran past spec.activeDeadlineSeconds ({spec['activeDeadlineSeconds']}s "
            "since status.startTime); its pods were stopped, checkpoints and buffer kept")
