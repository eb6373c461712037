"""What a running job reports, and how it becomes the RLJob's status.

A `StatusReader` observes one job: whether its trainer and buffer answer their gRPC health
checks, and the progress the services report (largest staleness trained on from the buffer, last
weight sync from weight-sync; stage, step, reward and policy version from the trainer). `GrpcStatusReader` asks the
services over gRPC: the standard health service, `kiln.v1.Buffer/GetStatus`,
`kiln.v1.WeightSync/Status`, and `kiln.v1.Trainer/GetTrainerStatus` (stage, step, reward).
`StaticStatusReader` is the in-process form: it returns whatever observation it was given.

`derive_status` is the pure rule from (previous status, observation) to the new status and
phase, shared by the operator's timer and its unit tests.

Not covered: writing the status to the cluster or posting events (`kiln.operator.handlers`).
"""
from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Protocol

import grpc

from kiln.control.clients import (BufferStatusClient, ServiceClient, TrainerControlClient,
                                  WeightSyncStatusClient)
from kiln.operator import lifecycle
from kiln.operator.naming import GRPC_PORT, JobRef
from kiln.tls import Bundle

WATCHED = ("trainer", "buffer")
"""Components whose health decides whether a job is Running."""

DEFAULT_ADDRESS = "{name}-{component}.{namespace}.svc:" + str(GRPC_PORT)


@dataclass
class Observation:
    """One look at a job. None means "not reported"; the previous value is kept."""

    serving: dict[str, bool] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    """Why a component is not serving (unreachable, NOT_SERVING, ...)."""
    stage: str | None = None
    policy_version: int | None = None
    step: int | None = None
    reward: float | None = None
    observed_staleness: int | None = None
    last_weight_sync: str | None = None
    stage_done: bool = False
    """The trainer finished the stage it reports."""
    finished: bool = False
    """The trainer completed every stage (the last stage is done)."""
    failure: str | None = None
    """The trainer stopped on an error that a restart will not fix."""


class StatusReader(Protocol):
    def read(self, job: JobRef) -> Observation: ...

    def close(self) -> None: ...


class StaticStatusReader:
    """In-process reader: returns the observation last `set` for a job (all NOT_SERVING before)."""

    def __init__(self) -> None:
        self._obs: dict[tuple[str, str], Observation] = {}
        self._lock = threading.Lock()

    def set(self, job_name: str, namespace: str, observation: Observation) -> None:
        with self._lock:
            self._obs[(namespace, job_name)] = observation

    def read(self, job: JobRef) -> Observation:
        with self._lock:
            found = self._obs.get((job.namespace, job.name))
        if found is None:
            return Observation(serving={c: False for c in WATCHED},
                               errors={c: "no observation" for c in WATCHED})
        return found

    def close(self) -> None:
        pass


class Addresses:
    """Where a job's component listens: the address template, unless an address map names it.

    The map (a JSON file of {"namespace/service": "host:port"}, read again when it changes) is
    for clusters whose Services are not reachable by DNS from the operator, such as the local
    development cluster (`kiln dev-cluster`), whose node agent writes it."""

    def __init__(self, template: str = DEFAULT_ADDRESS, map_file: str = "") -> None:
        self.template, self.map_file = template, map_file
        self._map: dict[str, str] = {}
        self._mtime = -1.0

    def __call__(self, job: JobRef, component: str) -> str:
        if self.map_file:
            self._reload()
            found = self._map.get(f"{job.namespace}/{job.child(component)}")
            if found:
                return found
        return self.template.format(name=job.name, namespace=job.namespace, component=component)

    def _reload(self) -> None:
        try:
            mtime = os.stat(self.map_file).st_mtime
        except FileNotFoundError:
            return
        if mtime != self._mtime:
            try:
                self._map = json.loads(Path(self.map_file).read_text())
                self._mtime = mtime
            except (OSError, ValueError):
                pass  # caught mid-write; the next call reads it again


class GrpcStatusReader:
    """Reads a job's services over gRPC: trainer and buffer health, the buffer's status (largest
    staleness served), weight-sync's latest committed version (a new one stamps
    `lastWeightSync`), and the trainer's progress (stage, step, reward, policy version). Through
    the control floor's clients, one try per read: the operator polls again anyway."""

    def __init__(self, address_template: str = DEFAULT_ADDRESS, timeout: float = 2.0,
                 addresses: Addresses | None = None,
                 credentials: Callable[[JobRef], Bundle | None] = lambda job: None) -> None:
        self.addresses = addresses or Addresses(address_template)
        self.credentials = credentials
        """The operator's certificate for a job (mutual TLS), None for plain text."""
        self.timeout = timeout
        self._clients: dict[tuple[str, str], ServiceClient] = {}
        self._published: dict[tuple[str, str], int] = {}
        self._lock = threading.Lock()

    def _client(self, job: JobRef, component: str):
        key = (job.uid, component)
        with self._lock:
            client = self._clients.get(key)
            if client is None:
                # The address is asked again on every call, the certificate on every new
                # channel (reading the job's CA is an API call).
                client = self._clients[key] = _CLIENTS[component](
                    lambda: self.address(job, component), timeout=self.timeout,
                    credentials=lambda: self.credentials(job), retry=False)
        return client

    def address(self, job: JobRef, component: str) -> str:
        return self.addresses(job, component)

    def read(self, job: JobRef) -> Observation:
        obs = Observation()
        for component in WATCHED:
            ok, why = self._client(job, component).health()
            obs.serving[component] = ok
            if not ok:
                obs.errors[component] = why
        if obs.serving.get("buffer"):
            self._read_buffer(job, obs)
        self._read_weight_sync(job, obs)
        if obs.serving.get("trainer"):
            self._read_trainer(job, obs)
        return obs

    @staticmethod
    def _ask(component: str, call: Callable[[], Any], obs: Observation):
        """One status read; None (the reason kept in `obs.errors`) if it failed."""
        try:
            return call()
        except grpc.RpcError as exc:
            obs.errors[component] = str(exc)
            return None

    def _read_buffer(self, job: JobRef, obs: Observation) -> None:
        st = self._ask("buffer", self._client(job, "buffer").status, obs)
        if st is not None and st.max_staleness >= 0:
            obs.observed_staleness = int(st.max_staleness)

    def _read_weight_sync(self, job: JobRef, obs: Observation) -> None:
        # Not needed for the phase; a failure is only kept for the log.
        latest = self._ask("weight-sync", self._client(job, "weight-sync").latest_version, obs)
        if latest is None:
            return
        key = (job.namespace, job.name)
        with self._lock:
            seen = self._published.get(key)
            self._published[key] = latest
        if latest > 0 and seen is not None and latest != seen:
            obs.last_weight_sync = rfc3339()

    def _read_trainer(self, job: JobRef, obs: Observation) -> None:
        st = self._ask("trainer", self._client(job, "trainer").status, obs)
        if st is None:
            return
        obs.stage = st.stage or None
        # The trainer owns the policy version; the buffer and weight-sync only echo it.
        obs.policy_version = int(st.policy_version)
        obs.step = int(st.stage_step)
        obs.stage_done = bool(st.stage_done)
        if st.last_step is not None and st.last_step.reward_mean is not None:
            obs.reward = float(st.last_step.reward_mean)
        if st.stage_failed:
            obs.failure = st.message or "stage failed"

    def forget(self, job: JobRef) -> None:
        with self._lock:
            self._published.pop((job.namespace, job.name), None)
            for key in [k for k in self._clients if k[0] == job.uid]:
                self._clients.pop(key).close()

    def close(self) -> None:
        with self._lock:
            for client in self._clients.values():
                client.close()
            self._clients.clear()


_CLIENTS = {"trainer": TrainerControlClient, "buffer": BufferStatusClient,
            "weight-sync": WeightSyncStatusClient}


def rfc3339(unix: float | None = None) -> str:
    moment = datetime.now(timezone.utc) if unix is None else datetime.fromtimestamp(unix, timezone.utc)
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


# ---------------------------------------------------------------------------------- status rule


CONDITION_MESSAGE_LIMIT = 32768
"""metav1.Condition's longest message."""


def set_condition(conditions: list[dict[str, Any]], type_: str, status: str, reason: str,
                  message: str, now: str, generation: int | None = None) -> list[dict[str, Any]]:
    """The conditions with one replaced, as metav1.Condition: lastTransitionTime moves only when
    status changes; observedGeneration is the spec generation it was set from (when known)."""
    out = [dict(c) for c in conditions if c.get("type") != type_]
    old = next((c for c in conditions if c.get("type") == type_), None)
    since = old.get("lastTransitionTime") if old and old.get("status") == status else now
    new = {"type": type_, "status": status, "reason": reason,
           "message": message[:CONDITION_MESSAGE_LIMIT], "lastTransitionTime": since or now}
    if generation is not None:
        new["observedGeneration"] = generation
    out.append(new)
    return sorted(out, key=lambda c: c["type"])


def derive_status(previous: dict[str, Any], obs: Observation, *, now: str,
                  generation: int | None = None) -> dict[str, Any]:
    """The new status of a valid, unsuspended job after one observation (a full replacement
    of the fields the timer owns: phase, progress, the Ready condition, message, start and
    completion times). `generation`: the spec's, for the conditions' observedGeneration."""
    generation = previous.get("observedGeneration") if generation is None else generation
    prev_phase = previous.get("phase") or "Pending"
    conditions = list(previous.get("conditions") or [])
    down = [c for c in WATCHED if not obs.serving.get(c)]
    if obs.failure:
        phase, message = "Failed", f"trainer failed: {obs.failure}"
        conditions = set_condition(conditions, "Ready", "False", "TrainerFailed", message, now,
                                   generation)
    elif obs.finished or prev_phase == "Succeeded":
        phase, message = "Succeeded", "every stage completed"
        conditions = set_condition(conditions, "Ready", "False", "Completed", message, now,
                                   generation)
    elif down:
        # A job that ran keeps its phase while a component restarts; Ready says what is down.
        phase = "Running" if prev_phase == "Running" else "Pending"
        message = "waiting for " + "; ".join(obs.errors.get(c, c) for c in down)
        conditions = set_condition(conditions, "Ready", "False", "ComponentsNotServing",
                                   message, now, generation)
    else:
        phase, message = "Running", ""
        conditions = set_condition(conditions, "Ready", "True", "Serving",
                                   "trainer and buffer are serving", now, generation)
    status = {
        "phase": phase,
        "conditions": conditions,
        "message": message,
        "stage": _pick(obs.stage, previous.get("stage")),
        "policyVersion": _pick(obs.policy_version, previous.get("policyVersion", 0)),
        "step": _pick(obs.step, previous.get("step", 0)),
        "reward": _pick(obs.reward, previous.get("reward")),
        "observedStaleness": _pick(obs.observed_staleness, previous.get("observedStaleness")),
        "lastWeightSync": _pick(obs.last_weight_sync, previous.get("lastWeightSync")),
        **lifecycle.times(previous, phase, now),
    }
    return status


def _pick(new: Any, old: Any) -> Any:
    return old if new is None else new
