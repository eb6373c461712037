"""The two ends a job's clock gives it, applied by the operator's status timer: failure past
`spec.activeDeadlineSeconds` (phase Failed, reason DeadlineExceeded, pods stopped) and deletion
`spec.ttlSecondsAfterFinished` after it finished. When each is due is `kiln.operator.lifecycle`'s
rule; this module writes the outcome.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable

import kopf

from kiln.api.spec import API_GROUP, API_VERSION, KIND
from kiln.operator import lifecycle
from kiln.operator.kube import Kube
from kiln.operator.status import rfc3339, set_condition

log = logging.getLogger("kiln.operator")


def ref(name: str, namespace: str) -> dict[str, Any]:
    return {"apiVersion": f"{API_GROUP}/{API_VERSION}", "kind": KIND,
            "metadata": {"name": name, "namespace": namespace}}


def enforce(kube: Kube, body: kopf.Body, status: dict[str, Any],
            stop: Callable[[], None]) -> str | None:
    """"deleted" (TTL), "failed" (deadline) or None (neither due). `stop()` scales the job's
    services to zero, as for any failure (the driver sees the phase and stops between polls)."""
    spec, name, namespace = dict(body.spec), body.meta["name"], body.meta["namespace"]
    if lifecycle.expired(spec, status, time.time()):
        # The finalizer then applies the PVC retention, as for any deletion.
        kube.delete(ref(name, namespace))
        log.info("%s/%s: deleted, %ss after it finished (spec.ttlSecondsAfterFinished)",
                 namespace, name, spec["ttlSecondsAfterFinished"])
        return "deleted"
    if not lifecycle.deadline_exceeded(spec, status, time.time()):
        return None
    now, generation = rfc3339(), body.meta.get("generation")
    message = lifecycle.deadline_message(spec)
    conditions = list(status.get("conditions") or [])
    for type_ in ("Driving", "Ready"):
        conditions = set_condition(conditions, type_, "False", lifecycle.DEADLINE_EXCEEDED,
                                   message, now, generation)
    failed = {"phase": "Failed", "message": message, "conditions": conditions,
              "rolloutReplicas": 0, **lifecycle.times(status, "Failed", now)}
    if not kube.patch_status_if_unchanged(ref(name, namespace), body.meta["resourceVersion"],
                                          failed):
        return None  # written meanwhile: the next tick looks again
    stop()
    kopf.event(body, type="Warning", reason=lifecycle.DEADLINE_EXCEEDED, message=message)
    return "failed"
