"""Teachers of on-policy distillation stages: one for all task sets or one per task set, each
task set taught exactly once, stage teachers earlier in the chain, one process per teacher."""
from __future__ import annotations

import pytest

from kiln.api.distillation import stage_teachers, teacher_process, teacher_refs
from kiln.api.spec import RLJob


def _job(opd_rl: dict, tasks=("a", "b")) -> RLJob:
    return RLJob.model_validate({
        "apiVersion": "kiln.dev/v1alpha1", "kind": "RLJob", "metadata": {"name": "d"},
        "spec": {"model": {"path": "m"},
                 "tasks": [{"name": n, "env": "chain", "generate": {"count": 4}} for n in ("a", "b")],
                 "stages": [{"name": "skill-a", "type": "sft", "tasks": ["a"]},
                            {"name": "skill-b", "type": "sft", "tasks": ["b"]},
                            {"name": "opd", "type": "rl", "tasks": list(tasks),
                             "rl": {"advantage": "opd", **opd_rl}}]}})


def test_a_teacher_per_task_set() -> None:
    job = _job({"teachers": [{"teacher": "skill-a", "tasks": ["a"]},
                             {"teacher": "/ckpt/b", "tasks": ["b"]}]})
    opd = job.spec.stages[2]
    assert stage_teachers(opd) == [("skill-a", ["a"]), ("/ckpt/b", ["b"])]
    assert teacher_refs(job.spec) == ["skill-a", "/ckpt/b"]
    assert [teacher_process(i) for i in range(2)] == ["teacher", "teacher_1"]
    assert job.spec.is_stage("skill-a") and not job.spec.is_stage("/ckpt/b")
    # One teacher for every task set of the stage.
    one = _job({"teacher": "skill-b"})
    assert stage_teachers(one.spec.stages[2]) == [("skill-b", ["a", "b"])]
    assert stage_teachers(one.spec.stages[0]) == []


@pytest.mark.parametrize(("rl", "message"), [
    ({"teachers": [{"teacher": "skill-a", "tasks": ["a"]}]}, r"task sets \['b'\] have no teacher"),
    ({"teachers": [{"teacher": "skill-a", "tasks": ["a", "b"]}, {"teacher": "skill-b", "tasks": ["b"]}]},
     r"task sets \['b'\] have two teachers"),
    ({"teachers": [{"teacher": "skill-a", "tasks": ["a", "b", "c"]}]}, r"task sets \['c'\] are not tasks"),
    ({"teachers": [{"teacher": "opd", "tasks": ["a", "b"]}]}, "does not come before this one"),
    ({"teacher": "skill-a", "teachers": [{"teacher": "skill-b", "tasks": ["a", "b"]}]},
     "set teacher or teachers"),
    ({}, "set teacher or teachers"),
])
def test_teachers_are_checked(rl: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _job(rl)
