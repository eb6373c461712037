"""Kubernetes job conventions as pure rules (`kiln.operator.lifecycle`): start and completion
times across suspend, resume, failure and restart; the active deadline; the TTL after finishing
(never a job that still runs); who manages a job; conditions as metav1.Condition. The operator
applying them to a live RLJob is test_operator_e2e's."""
from __future__ import annotations

import copy

import pytest
from pydantic import ValidationError

from kiln.api.spec import RLJobSpec
from kiln.operator import lifecycle
from kiln.operator.status import Observation, derive_status, rfc3339, set_condition

from helpers.operator_jobs import SMALL

T0, T1 = "2026-01-01T00:00:00Z", "2026-01-01T01:00:00Z"


@pytest.mark.parametrize("old, new, start, done", [
    (None, "Pending", T1, None),                # first start
    (None, "Suspended", None, None),            # created suspended: not started
    ("Pending", "Running", T0, None),           # still the same run
    ("Running", "Suspended", T0, None),         # suspension keeps it (a resume resets it)
    ("Suspended", "Pending", T1, None),         # resumed
    ("Running", "Succeeded", T0, T1),
    ("Running", "Failed", T0, T1),
    ("Succeeded", "Succeeded", T0, T0),         # a spec edit of a finished job changes nothing
    ("Failed", "Pending", T1, None),            # restarted by an edit
])
def test_start_and_completion_times(old: str | None, new: str, start: str | None,
                                    done: str | None) -> None:
    previous = {} if old is None else {"phase": old, "startTime": T0}
    if old in lifecycle.FINISHED:
        previous["completionTime"] = T0
    assert lifecycle.times(previous, new, T1) == {"startTime": start, "completionTime": done}


def test_deadline_counts_from_start_while_the_job_runs() -> None:
    spec = {"activeDeadlineSeconds": 60}
    start = lifecycle.unix(T0)
    running = {"phase": "Running", "startTime": T0}
    assert lifecycle.deadline_exceeded(spec, running, start + 60)
    assert not lifecycle.deadline_exceeded(spec, running, start + 59)
    assert not lifecycle.deadline_exceeded({}, running, start + 1e6)
    for phase in ("Suspended", "Succeeded", "Failed"):
        assert not lifecycle.deadline_exceeded(spec, {**running, "phase": phase}, start + 1e6)


def test_ttl_deletes_only_a_finished_job() -> None:
    spec = {"ttlSecondsAfterFinished": 30}
    done = lifecycle.unix(T0)
    for phase in lifecycle.FINISHED:
        finished = {"phase": phase, "completionTime": T0}
        assert lifecycle.expired(spec, finished, done + 30)
        assert not lifecycle.expired(spec, finished, done + 29)
        assert lifecycle.expired({"ttlSecondsAfterFinished": 0}, finished, done)
        assert not lifecycle.expired({}, finished, done + 1e6)
    # A job restarted by an edit may still carry its last completionTime: it runs, it stays.
    for phase in ("Pending", "Running", "Suspended"):
        assert not lifecycle.expired(spec, {"phase": phase, "completionTime": T0}, done + 1e6)


def test_managed_by() -> None:
    assert lifecycle.ours({}) and lifecycle.ours({"managedBy": None})
    assert lifecycle.ours({"managedBy": "kiln.dev/operator"})
    assert not lifecycle.ours({"managedBy": "kueue.x-k8s.io/multikueue"})


@pytest.mark.parametrize("field, value", [
    ("managedBy", "multikueue"), ("managedBy", "a/" + "b" * 70),
    ("activeDeadlineSeconds", 0), ("ttlSecondsAfterFinished", -1)])
def test_bad_convention_fields_are_refused(field: str, value: object) -> None:
    with pytest.raises(ValidationError, match=field):
        RLJobSpec.model_validate({**copy.deepcopy(SMALL), field: value})


def test_conditions_carry_observed_generation_and_bounded_messages() -> None:
    conditions = set_condition([], "Valid", "True", "Accepted", "ok", T0, 3)
    assert conditions == [{"type": "Valid", "status": "True", "reason": "Accepted", "message": "ok",
                           "lastTransitionTime": T0, "observedGeneration": 3}]
    # Same status: the transition time stays; the generation follows the spec.
    again = set_condition(conditions, "Valid", "True", "Accepted", "x" * 40000, T1, 4)
    assert again[0]["lastTransitionTime"] == T0 and again[0]["observedGeneration"] == 4
    assert len(again[0]["message"]) == 32768


def test_derive_status_stamps_generation_and_times() -> None:
    serving = Observation(serving={"trainer": True, "buffer": True})
    previous = {"phase": "Pending", "startTime": T0, "observedGeneration": 2}
    new = derive_status(previous, serving, now=T1)
    assert new["phase"] == "Running" and new["startTime"] == T0 and new["completionTime"] is None
    assert {c["observedGeneration"] for c in new["conditions"]} == {2}
    failed = derive_status(new, Observation(serving={"trainer": True, "buffer": True},
                                            failure="boom"), now=T1, generation=2)
    assert failed["phase"] == "Failed" and failed["completionTime"] == T1


def test_rfc3339_round_trips() -> None:
    assert rfc3339(lifecycle.unix(T1)) == T1
