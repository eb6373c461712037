"""Driving an applied RLJob through its stages, from the operator.

The operator runs one kopf daemon per RLJob (`kiln.operator.handlers.drive_job`); the daemon
runs the same `kiln.control.driver.Driver` as `kiln run`, talking to the job's services over gRPC
through the control floor's clients (`kiln.operator.replicas`). Why the operator and not a
driver Job: docs/design-notes.md.

What is done lives in the RLJob's status, so an operator that restarts (or another replica that
takes over) resumes where the last one was: `status.finishedStages` and `status.evaluations`
(`StatusStore`), with `status.selections`, the checkpoint each guarded stage ended with and why
(also posted as an event). The driver is level-triggered: it re-sends the current stage to a trainer or
rollout that restarted. A suspend (`spec.suspend`), deletion or operator shutdown stops it
between polls (`Stopped`); nothing is lost, the trainer keeps its checkpoints.

The driver logs to the job's trackers as `kiln run`'s does (`spec.tracking`, `kiln.tracking`):
each held-out evaluation (`eval/<task set>/...`), and every poll the job's progress
(`progress/...`) and rollout's and the buffer's figures, at the trainer's global step, so they
line up with the trainer's own `train/...` scalars. W&B runs are grouped under the job's name
beside the trainer's (run `driver`). TensorBoard: with `spec.output` the scalars go to the
trainer (`RecordScalars`), which writes them beside its own and copies both to the output
location (`tensorboard/`), where the job's other results are; the operator cannot write there.
Without an output they go to the operator's tracking folder,
`<KILN_OPERATOR_TRACKING_DIR>/<namespace>/<job>/driver` (`job_tracker`).

When every stage is done the daemon records `phase: Succeeded`; a driver error that a retry will
not fix (the trainer failed, a service stayed away for `unavailable_seconds`) records `Failed`
with the reason in the `Driving` condition.
"""
from __future__ import annotations

import logging
import math
import tempfile
import threading
from pathlib import Path
from typing import Any, Callable

from kiln.api.spec import API_GROUP, API_VERSION, KIND, RLJob
from kiln.api.status import CheckpointSelection, EvaluationResult
from kiln.control.driver import (ControlPlane, Driver, DriverHooks, DriverOptions, Progress,
                                 RunState, Stopped)
from kiln.operator import lifecycle
from kiln.operator.replicas import TRANSIENT, Controls
from kiln.operator.kube import Kube
from kiln.operator.naming import JobRef
from kiln.operator.status import rfc3339, set_condition
from kiln.tracking import Tracker

log = logging.getLogger("kiln.operator")


class StatusStore:
    """`RunState` kept in the RLJob's status (merge-patched; the driver is its only writer)."""

    def __init__(self, kube: Kube, job: JobRef, current: Callable[[], dict[str, Any]],
                 on_finished: Callable[[list[str]], None] = lambda finished: None) -> None:
        self.kube, self.job, self.current = kube, job, current
        self.on_finished = on_finished
        self._finished: list[str] = []

    def ref(self) -> dict[str, Any]:
        return {"apiVersion": f"{API_GROUP}/{API_VERSION}", "kind": KIND,
                "metadata": {"name": self.job.name, "namespace": self.job.namespace}}

    def load(self) -> dict[str, Any]:
        status = self.current()
        evaluations = {key: EvaluationResult.model_validate(value).model_dump()
                       for key, value in (status.get("evaluations") or {}).items()}
        self._finished = list(status.get("finishedStages") or [])
        selections = {stage: CheckpointSelection.model_validate(value).model_dump()
                      for stage, value in (status.get("selections") or {}).items()}
        return {"finished_stages": list(self._finished), "evaluations": evaluations,
                "selections": selections}

    def save(self, data: dict[str, Any]) -> None:
        # The CRD's schema names fields in camelCase (a real API server prunes others).
        evaluations = {key: EvaluationResult.model_validate(value).model_dump(by_alias=True)
                       for key, value in data["evaluations"].items()}
        selections = {stage: CheckpointSelection.model_validate(value).model_dump(by_alias=True)
                      for stage, value in data.get("selections", {}).items()}
        self.patch({"finishedStages": data["finished_stages"], "evaluations": evaluations,
                    "selections": selections})
        if data["finished_stages"] != self._finished:
            self.on_finished(list(data["finished_stages"]))
        self._finished = list(data["finished_stages"])

    def patch(self, status: dict[str, Any]) -> None:
        self.kube.merge_patch_status(self.ref(), status)


class SpecReplicas:
    """Autoscaling on a cluster: the decision becomes the RLJob's `spec.rollout.replicas`, which
    the update handler reconciles into the rollout Deployment like any edit (and which an HPA
    would write through the scale subresource instead). New pods join at the current policy
    version (weight sync sends the latest on subscribe; rollout waits for it before its first
    episode); a pod scaled away gets SIGTERM and finishes its episodes in its grace period."""

    def __init__(self, kube: Kube, ref: dict[str, Any], current: Callable[[], int],
                 serving: Callable[[], int]) -> None:
        self.kube, self.ref, self.current, self.serving = kube, ref, current, serving

    def replicas(self) -> int:
        return self.current()

    def settled(self) -> bool:
        # The headless Service lists ready pods only: as many as asked means they all serve
        # (and any scaled away has left).
        return self.serving() == self.current()

    def scale(self, replicas: int) -> None:
        self.kube.merge_patch(self.ref, {"spec": {"rollout": {"replicas": replicas}}})


def job_tracker(job: RLJob, ref: JobRef, tracking_dir: Path | None) -> Tracker:
    """The driver's tracker of one job: TensorBoard event files in
    `tracking_dir/<namespace>/<name>/driver` (none without a `tracking_dir`, or with
    `spec.tracking.tensorboard` off) and a W&B run when `spec.tracking.wandb` is set.
    ValueError when W&B is asked for and the `wandb` package is missing, OSError when the
    folder cannot be made."""
    spec = job.spec.tracking
    if tracking_dir is None:  # W&B keeps its files (offline mode's run) in a scratch folder
        spec = spec.model_copy(update={"tensorboard": False})
        tracking_dir = Path(tempfile.gettempdir()) / "kiln-tracking"
    return Tracker(Path(tracking_dir) / ref.namespace / ref.name / "driver", run_name="driver",
                   group=job.metadata.name, spec=spec)


class TrainerScalars:
    """The driver's tracker when the job has an output location: each call's scalars also go to
    the trainer (`RecordScalars`), which keeps them for the output's TensorBoard files; `inner`
    (W&B) gets them as well. A failed call is logged and dropped: tracking never stops a job."""

    def __init__(self, trainer: Any, inner: Tracker | None, name: str) -> None:
        self.trainer, self.inner, self.name = trainer, inner, name
        self.failures = 0

    def log(self, step: int, scalars: dict[str, float | None]) -> None:
        if self.inner is not None:
            self.inner.log(step, scalars)
        values = {k: float(v) for k, v in scalars.items()
                  if v is not None and math.isfinite(float(v))}
        if not values:
            return
        try:
            self.trainer.record_scalars(step, values)
        except Exception as exc:  # any failure of the call: a gap in a plot, never a stop
            self.failures += 1
            if self.failures in (1, 10, 100) or self.failures % 1000 == 0:
                log.warning("%s: scalars at step %d not recorded by the trainer (%d so far): %s",
                            self.name, step, self.failures, exc)

    def close(self) -> None:
        if self.inner is not None:
            self.inner.close()


def drive(job: RLJob, ref: JobRef, kube: Kube, address: Callable[[str], str],
          current_status: Callable[[], dict[str, Any]], stopped: threading.Event | Any,
          suspended: Callable[[], bool], *, poll_seconds: float = 2.0,
          unavailable_seconds: float = 900.0,
          credentials: Callable[[], Any] = lambda: None,
          rollout_replicas: Callable[[], int] | None = None,
          on_stage_finished: Callable[[list[str]], None] = lambda finished: None,
          on_event: Callable[[str, str], None] = lambda reason, message: None,
          tracking_dir: Path | None = None) -> str:
    """Run the job's remaining stages; returns the outcome: succeeded, failed or stopped.
    `rollout_replicas()`: the live spec's rollout replica count (autoscaling changes it).
    `on_stage_finished(finished)`: called once a stage is recorded done (frozen deployments
    made by that stage can start now, without waiting for the next drift repair).
    `on_event(reason, message)`: posts a Kubernetes event on the RLJob (a guarded stage's
    checkpoint selection, `CheckpointSelected` or `StoppedOnRegression`).
    `tracking_dir`: where the job's TensorBoard files go (`job_tracker`); None: nowhere."""
    store = StatusStore(kube, ref, current_status, on_stage_finished)
    state = RunState.load(store)
    names = [s.name for s in job.spec.stages]
    if all(n in state.finished_stages for n in names):
        return "succeeded"
    controls = Controls.open(address, credentials=credentials)
    tracker = None
    to_output = job.spec.output is not None and job.spec.tracking.tensorboard
    try:
        # With an output location, TensorBoard's files are the trainer's to write (there).
        tracker = job_tracker(job, ref, None if to_output else tracking_dir)
    except (ValueError, OSError) as exc:  # W&B not installed, a folder not writable: untracked
        log.error("%s/%s: not tracked: %s", ref.namespace, ref.name, exc)
        on_event("TrackingUnavailable", str(exc))
    if to_output:
        tracker = TrainerScalars(controls.trainer, tracker, f"{ref.namespace}/{ref.name}")
    last_logged = [0.0]

    def on_progress(p: Progress) -> None:
        if p.elapsed - last_logged[0] >= 30:
            last_logged[0] = p.elapsed
            log.info("%s/%s stage %s step %d/%d version %d", ref.namespace, ref.name,
                     p.stage.name, p.step, p.stage.max_steps, p.trainer.policy_version)

    scaler = SpecReplicas(kube, store.ref(), rollout_replicas or (lambda: job.spec.rollout.replicas),
                          controls.rollout.serving)
    def event(e: dict[str, Any]) -> None:
        if e.get("event") == "selection":
            on_event("StoppedOnRegression" if e["stopped"] else "CheckpointSelected",
                     f"stage {e['stage']} ends with the weights of its step {e['step']}: {e['reason']}")

    driver = Driver(
        job, ControlPlane(controls.trainer, controls.rollout, controls.buffer, scaler), state,
        DriverHooks(say=lambda s: log.info("%s/%s %s", ref.namespace, ref.name, s.strip()),
                    on_progress=on_progress, on_event=event,
                    should_stop=lambda: bool(stopped.is_set()) or suspended(), tracker=tracker),
        DriverOptions(poll_seconds=poll_seconds, transient=TRANSIENT,
                      unavailable_seconds=unavailable_seconds))
    try:
        driver.run()
    except Stopped:
        return "stopped"
    except RuntimeError as exc:
        now, status = rfc3339(), current_status()
        conditions = set_condition(list(status.get("conditions") or []), "Driving",
                                   "False", "StageFailed", str(exc), now,
                                   status.get("observedGeneration"))
        store.patch({"phase": "Failed", "message": f"driver: {exc}", "conditions": conditions,
                     **lifecycle.times(status, "Failed", now)})
        return "failed"
    finally:
        controls.close()
        if tracker is not None:
            tracker.close()
    now, status = rfc3339(), current_status()
    generation = status.get("observedGeneration")
    conditions = set_condition(list(status.get("conditions") or []), "Driving",
                               "False", "Completed", "every stage finished", now, generation)
    # The services scale to zero next; nothing serves any more.
    conditions = set_condition(conditions, "Ready", "False", "Completed",
                               "every stage completed", now, generation)
    store.patch({"phase": "Succeeded", "message": "every stage completed",
                 "conditions": conditions, **lifecycle.times(status, "Succeeded", now)})
    return "succeeded"
