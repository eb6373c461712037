"""Kopf handlers of the Kiln operator: RLJob create/update/resume, delete, status timer, probes.

Each handler turns the event into calls of the pure functions and the reconciler:
- create, update (of `spec`) and resume apply the desired children; a spec that fails
  validation, or changes an immutable field, is refused: nothing is applied, the reason goes
  to `status.message` and the `Valid` condition, and a Warning event is posted;
- a daemon per job drives its stages (`kiln.operator.driving`): what is finished and each
  evaluation go to status, and the final phase (Succeeded, or Failed with the reason);
- the timer reads each job's trainer and buffer (gRPC) and keeps status current (a phase change
  posts an event), and re-applies the children every `repair_interval` (a deleted or hand-edited
  child comes back; fields others added are left alone); it also fails a job past
  `spec.activeDeadlineSeconds` and deletes one `spec.ttlSecondsAfterFinished` after it ended
  (`kiln.operator.deadlines`);
- a job whose `spec.managedBy` names another controller matches no handler;
- delete runs under the finalizer `kiln.dev/pvc-retention` and applies the PVC retention policy;
  every other child goes with its owner reference.

Handlers are synchronous (kopf runs them in worker threads) because the Kubernetes and gRPC
clients they call block.

Not covered: the manifests (`children`, `workloads`), the client (`kube`), the status rule
(`status.derive_status`).
"""
from __future__ import annotations

import asyncio
import contextvars
import logging
import threading
import time
from typing import Any

import kopf

from kiln.api.spec import API_GROUP, API_VERSION, KIND, PLURAL, RLJob
from kiln.operator import deadlines, driving, frozen, lifecycle, metrics, tls
from kiln.operator.config import OperatorConfig
from kiln.operator.kube import Kube, load_credentials
from kiln.operator.naming import FINALIZER, JobRef, selector_labels
from kiln.operator.reconcile import accepted_spec, finalize, parse_spec, reconcile
from kiln.operator.status import (Addresses, GrpcStatusReader, derive_status, rfc3339,
                                  set_condition)
from kiln.operator.tls import Credentials

RESOURCE = (API_GROUP, API_VERSION, PLURAL)
# The timer ticks often and reads a job only when `status_interval` has passed, so the
# interval is a runtime setting rather than one fixed when the module is imported.
_TICK = 1.0

_phases: dict[str, str] = {}
_phases_lock = threading.Lock()


def _track(namespace: str, name: str, phase: str | None) -> None:
    with _phases_lock:
        key = f"{namespace}/{name}"
        if phase is None:
            _phases.pop(key, None)
        else:
            _phases[key] = phase
        counts: dict[str, int] = {}
        for p in _phases.values():
            counts[p] = counts.get(p, 0) + 1
    for p in ("Pending", "Running", "Succeeded", "Failed", "Suspended"):
        metrics.JOBS.labels(p).set(counts.get(p, 0))


def _ours(spec: kopf.Spec, **_: Any) -> bool:
    """Jobs whose `spec.managedBy` names another controller get no handler (and no finalizer)."""
    return lifecycle.ours(dict(spec))


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, logger: kopf.Logger,
              **_: Any) -> None:
    config = OperatorConfig.from_env()
    settings.persistence.finalizer = FINALIZER
    # The CRD's structural schema would prune kopf's bookkeeping from status; keep it in
    # annotations under the API group instead.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=API_GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=API_GROUP, key="last-handled-configuration")
    # One replica; no peering CRDs to install or watch.
    settings.peering.standalone = True
    # kopf's own log lines stay in the log; users see the operator's explicit events.
    settings.posting.level = logging.WARNING
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.execution.max_workers = 8
    load_credentials()
    tls.set_lifetimes(config.lifetimes)
    memo.config = config
    memo.kube = Kube()
    memo.addresses = Addresses(config.address_template, config.address_map)
    memo.credentials = Credentials(memo.kube)
    memo.reader = GrpcStatusReader(timeout=config.grpc_timeout, addresses=memo.addresses,
                                   credentials=memo.credentials)
    logger.info("kiln operator configured: %s", config.model_dump())


@kopf.on.login()
def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    """The pod's service account in a cluster, else KUBECONFIG as set when the operator starts."""
    return kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)


@kopf.on.cleanup()
def close(memo: kopf.Memo, **_: Any) -> None:
    reader = memo.get("reader")
    if reader is not None:
        reader.close()


@kopf.on.probe(id="jobs")
def jobs_probe(**_: Any) -> int:
    with _phases_lock:
        return len(_phases)


def _event_phase(body: kopf.Body, old: str | None, new: str, message: str) -> None:
    if old == new:
        return
    kind = "Warning" if new == "Failed" else "Normal"
    text = f"phase {old or 'None'} -> {new}" + (f": {message}" if message else "")
    kopf.event(body, type=kind, reason=new, message=text)


def _refuse(body: kopf.Body, patch: kopf.Patch, status: dict[str, Any], reason: str,
            problems: list[str], phase: str | None) -> None:
    now = rfc3339()
    message = "; ".join(problems)
    conditions = set_condition(list(status.get("conditions") or []), "Valid", "False", reason,
                               message, now, body.meta.get("generation"))
    patch.status["conditions"] = conditions
    patch.status["message"] = f"spec refused ({reason}): {message}"
    patch.status["observedGeneration"] = body.meta.get("generation")
    if phase is not None:
        patch.status["phase"] = phase
        _event_phase(body, status.get("phase"), phase, "")
    kopf.event(body, type="Warning", reason=reason, message=message[:1000])
    metrics.RECONCILES.labels("refused").inc()


@kopf.on.resume(*RESOURCE, when=_ours)
@kopf.on.create(*RESOURCE, when=_ours)
@kopf.on.update(*RESOURCE, field="spec", when=_ours)
def reconcile_job(body: kopf.Body, name: str, namespace: str, uid: str, patch: kopf.Patch,
                  memo: kopf.Memo, logger: kopf.Logger, **_: Any) -> None:
    status = dict(body.get("status") or {})
    spec, problems = parse_spec(name, dict(body.spec), memo.config.image_registry)
    if spec is None:
        # A spec that fails validation will not pass on retry; the user has to edit it.
        _refuse(body, patch, status, "InvalidSpec", problems, "Failed")
        _track(namespace, name, "Failed")
        return
    not_allowed = memo.config.refusals(spec)
    if not_allowed:
        # The operator's own policy: editing the spec (or the operator's settings) is the fix.
        _refuse(body, patch, status, "NotAllowed", not_allowed, "Failed")
        _track(namespace, name, "Failed")
        return
    job = JobRef(name=name, namespace=namespace, uid=uid)
    old_phase = status.get("phase")
    generation = body.meta.get("generation")
    if spec.suspend:
        phase, message = "Suspended", "scaled to zero (spec.suspend)"
    elif old_phase in (None, "Suspended") or (
            # An edited spec restarts a failed job, and so does an operator restarted with
            # settings that may now allow a refused one; one that failed running stays failed.
            old_phase == "Failed" and (status.get("observedGeneration") != generation
                                       or _refused(status))):
        phase, message = "Pending", "children applied; waiting for the trainer and buffer"
    else:
        phase, message = old_phase, "" if _refused(status) else status.get("message", "")
    result = reconcile(memo.kube, job, spec, hosting=memo.config.hosting,
                       active=_active(spec, {**status, "phase": phase}),
                       finished_stages=list(status.get("finishedStages") or []))
    if result.refused:
        # The job keeps running on the spec it was accepted with.
        _refuse(body, patch, status, "ImmutableFieldChanged", result.refused, None)
        return
    if result.not_adopted:
        # Another job's volume under this job's name: deleting or relabelling it is the fix.
        _refuse(body, patch, status, "PVCNotAdopted", result.not_adopted, "Failed")
        _track(namespace, name, "Failed")
        return
    changed = {k: v for k, v in result.actions.items() if v != "unchanged"}
    logger.info("applied %d children (%s)", len(result.actions),
                ", ".join(f"{k} {v}" for k, v in changed.items()) or "all unchanged")
    now = rfc3339()
    conditions = set_condition(list(status.get("conditions") or []), "Valid", "True",
                               "Accepted", "spec accepted", now, generation)
    if spec.suspend:
        conditions = set_condition(conditions, "Ready", "False", "Suspended", message, now,
                                   generation)
    patch.status.update(lifecycle.times(status, phase, now))
    patch.status["phase"] = phase
    patch.status["conditions"] = conditions
    patch.status["message"] = message
    patch.status["observedGeneration"] = generation
    # What the scale subresource reads back (kubectl scale, an HPA, KEDA).
    patch.status["rolloutReplicas"] = (spec.rollout.replicas
                                       if _active(spec, {**status, "phase": phase}) else 0)
    patch.status["rolloutSelector"] = ",".join(
        f"{k}={v}" for k, v in selector_labels(job, "rollout").items())
    _event_phase(body, old_phase, phase, message)
    _track(namespace, name, phase)
    metrics.RECONCILES.labels("applied").inc()


def _active(spec: Any, status: dict[str, Any]) -> bool:
    """Whether the job's services should run: not suspended and not finished (a finished job,
    Succeeded or Failed, gives its nodes back; its checkpoints and buffer stay in their PVCs)."""
    return not spec.suspend and status.get("phase") not in lifecycle.FINISHED


def _done(status: dict[str, Any]) -> bool:
    """The driver recorded an outcome (Succeeded, or Failed for a reason a retry won't fix)."""
    return status.get("phase") in ("Succeeded", "Failed")


def _valid(status: dict[str, Any]) -> bool:
    return not any(c.get("type") == "Valid" and c.get("status") == "False"
                   and c.get("reason") == "InvalidSpec" for c in status.get("conditions") or [])


def _refused(status: dict[str, Any]) -> bool:
    return any(c.get("type") == "Valid" and c.get("status") == "False"
               for c in status.get("conditions") or [])


@kopf.timer(*RESOURCE, interval=_TICK, when=_ours)
def refresh_status(body: kopf.Body, name: str, namespace: str, uid: str, memo: kopf.Memo,
                   **_: Any) -> None:
    status = dict(body.get("status") or {})
    if not status.get("phase") or not _valid(status):
        return  # not reconciled yet, or refused
    if body.meta.get("deletionTimestamp"):
        return  # being deleted: a repair now would bring back what the finalizer removes
    if status.get("observedGeneration") != body.meta.get("generation"):
        return  # a spec change is being reconciled; its handler sets the phase first
    # `memo` here is this object's own copy of the operator's memo.
    now = time.monotonic()
    job = JobRef(name=name, namespace=namespace, uid=uid)
    ended = deadlines.enforce(memo.kube, body, status, stop=lambda: _repair(
        body, name, job, {**status, "phase": "Failed"}, memo))
    if ended:
        _track(namespace, name, "Failed" if ended == "failed" else None)
        return
    if now - memo.get("last_repair", now) >= memo.config.repair_interval:
        _repair(body, name, job, status, memo)
    memo.setdefault("last_repair", now)
    if status["phase"] == "Suspended" or _done(status):
        return  # nothing runs to be observed
    if now - memo.get("last_read", -1e9) < memo.config.status_interval:
        return
    memo.last_read = now
    obs = memo.reader.read(job)
    new = derive_status(status, obs, now=rfc3339())
    if _refused(status):
        # The refusal (an immutable field) is what the user must read; keep it as the message.
        new.pop("message")
    changed = {k: v for k, v in new.items() if status.get(k) != v}
    if not changed:
        return
    # Optimistic concurrency: a handler may have written status since this body was read
    # (kopf's merge patches would let a stale conditions list win). On a conflict the next
    # tick reads again.
    if not memo.kube.patch_status_if_unchanged(deadlines.ref(name, namespace),
                                               body.meta["resourceVersion"], changed):
        memo.last_read = -1e9
        return
    _event_phase(body, status.get("phase"), new["phase"], new.get("message", ""))
    _track(namespace, name, new["phase"])


def _repair(body: kopf.Body, name: str, job: JobRef, status: dict[str, Any],
            memo: kopf.Memo) -> None:
    """Re-apply the children (level-triggered drift repair)."""
    memo.last_repair = time.monotonic()
    spec, _problems = parse_spec(name, dict(body.spec), memo.config.image_registry)
    if spec is None or memo.config.refusals(spec):
        return
    result = reconcile(memo.kube, job, spec, hosting=memo.config.hosting,
                       active=_active(spec, status),
                       finished_stages=list(status.get("finishedStages") or []))
    repaired = {k: v for k, v in result.actions.items() if v != "unchanged"}
    if repaired:
        logging.getLogger("kiln.operator").info(
            "%s/%s: repaired %s", job.namespace, job.name,
            ", ".join(f"{k} ({v})" for k, v in repaired.items()))
        kopf.event(body, type="Normal", reason="Repaired",
                   message="re-applied " + ", ".join(sorted(repaired)))


# How long a stopping daemon may take to notice (it checks between polls).
_DRIVE_POLL = 2.0


@kopf.daemon(*RESOURCE, initial_delay=1.0, cancellation_timeout=30.0, when=_ours)
async def drive_job(stopped: kopf.DaemonStopped, body: kopf.Body, name: str, namespace: str,
                    uid: str, memo: kopf.Memo, logger: kopf.Logger, **_: Any) -> None:
    """Drive the job's stages (in a thread of its own: the driver blocks for a job's whole life,
    and kopf's worker threads, `max_workers` of them, are for the handlers of every job)."""
    loop = asyncio.get_running_loop()
    finished = asyncio.Event()
    context = contextvars.copy_context()  # kopf's event posting reads its context variables

    def target() -> None:
        try:
            context.run(_drive_until_stopped, stopped, body, JobRef(name=name, namespace=namespace,
                                                                   uid=uid), memo, logger)
        finally:
            loop.call_soon_threadsafe(finished.set)

    threading.Thread(target=target, name=f"drive {namespace}/{name}", daemon=True).start()
    await finished.wait()


def _pause(stopped: kopf.DaemonStopped, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not stopped.is_set() and time.monotonic() < deadline:
        time.sleep(0.1)


def _drive_until_stopped(stopped: kopf.DaemonStopped, body: kopf.Body, job: JobRef,
                         memo: kopf.Memo, logger: kopf.Logger) -> None:
    """Drive the job whenever it is accepted, active and not finished. `body` is kopf's live
    view of the object: a suspend or a spec change is seen between polls."""

    def current() -> dict[str, Any]:
        return dict(body.get("status") or {})

    while not stopped.is_set():
        status = current()
        ready = (status.get("phase") in ("Pending", "Running") and _valid(status)
                 and status.get("observedGeneration") == body.meta.get("generation")
                 and not body.meta.get("deletionTimestamp"))
        spec = parse_spec(job.name, dict(body.spec), memo.config.image_registry)[0] if ready else None
        if spec is None or spec.suspend:
            _pause(stopped, _DRIVE_POLL)
            continue
        rljob = RLJob.model_validate({"apiVersion": f"{API_GROUP}/{API_VERSION}", "kind": KIND,
                                      "metadata": {"name": job.name}, "spec": dict(body.spec)})

        def stage_finished(finished: list[str], spec=spec) -> None:
            # Frozen deployments made by the stage just done start now (`frozen.py`).
            if frozen.fetching(spec):
                result = reconcile(memo.kube, job, spec, hosting=memo.config.hosting,
                                   active=True, finished_stages=finished)
                started = sorted(k for k, v in result.actions.items() if v != "unchanged")
                logger.info("stage done (%s); re-applied %s", finished[-1],
                            ", ".join(started) or "nothing (no change)")
        try:
            outcome = driving.drive(
                rljob, job, memo.kube, lambda component: memo.addresses(job, component),
                current, stopped,
                lambda: (bool(body.spec.get("suspend")) or bool(body.meta.get("deletionTimestamp"))
                         or current().get("phase") not in lifecycle.ACTIVE),
                poll_seconds=_DRIVE_POLL, unavailable_seconds=memo.config.unavailable_seconds,
                credentials=lambda: memo.credentials(job),
                rollout_replicas=lambda: int((body.spec.get("rollout") or {}).get("replicas", 1)),
                on_stage_finished=stage_finished,
                on_event=lambda reason, message: kopf.event(body, type="Normal", reason=reason,
                                                            message=message),
                tracking_dir=memo.config.tracking_dir or None)
        except Exception:  # noqa: BLE001 - an API error must not end this job's driving for good
            logger.exception("driver stopped on an error; starting again")
            _pause(stopped, 10 * _DRIVE_POLL)
            continue
        logger.info("driver: %s", outcome)
        if outcome == "succeeded":
            kopf.event(body, type="Normal", reason="Succeeded", message="every stage completed")
            # Give the nodes back: the services scale to zero, PVCs stay.
            reconcile(memo.kube, job, spec, hosting=memo.config.hosting, active=False)
            _track(job.namespace, job.name, "Succeeded")
        elif outcome == "failed":
            kopf.event(body, type="Warning", reason="Failed",
                       message=str(current().get("message", ""))[:1000])
            # A failed job gives its nodes back too; editing its spec starts it again.
            reconcile(memo.kube, job, spec, hosting=memo.config.hosting, active=False)
            _track(job.namespace, job.name, "Failed")
        _pause(stopped, _DRIVE_POLL)


@kopf.on.delete(*RESOURCE, when=_ours)
def delete_job(body: kopf.Body, name: str, namespace: str, uid: str, memo: kopf.Memo,
               logger: kopf.Logger, **_: Any) -> None:
    job = JobRef(name=name, namespace=namespace, uid=uid)
    spec, _problems = parse_spec(name, dict(body.spec), memo.config.image_registry)
    if spec is None:
        spec = accepted_spec(memo.kube, job)
    outcome = finalize(memo.kube, job, spec)
    memo.reader.forget(job)
    memo.credentials.forget(job)
    logger.info("PVC retention applied: %s", outcome)
    _track(namespace, name, None)
