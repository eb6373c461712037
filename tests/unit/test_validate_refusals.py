"""`kiln validate` (and so `kiln run`'s pre-flight) refuses what would fail later, naming the
field and its line: a task file that is not there (relative to the job file), a teacher that is
neither a stage nor a checkpoint (a near miss of a stage's name suggested), a job name its
children cannot carry (on the cluster path too). Relative model paths are relative to the
working directory, task paths to the job file."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from helpers.capabilities import checkpoint_config
from kiln.api.names import MAX_JOB_NAME
from kiln.api.paths import resolve
from kiln.api.validate import validate_file, validate_text
from kiln.operator.children import desired_children
from kiln.operator.naming import JobRef
from kiln.operator.reconcile import parse_spec

DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


def _job(name: str = "demo", **spec) -> dict:
    return {"apiVersion": "kiln.dev/v1alpha1", "kind": "RLJob", "metadata": {"name": name},
            "spec": {"model": {"path": "m", "init": {}},
                     "tasks": [{"name": "train", "env": "chain", "generate": {"count": 10}}],
                     "stages": [{"name": "sft", "type": "sft", "tasks": ["train"]}], **spec}}


def _write(path: Path, job: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return path


def _line_of(path: Path, text: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if text in line)


def test_a_task_file_is_looked_for_beside_the_job_file(tmp_path, monkeypatch) -> None:
    job = _job(tasks=[{"name": "train", "env": "terminal", "path": "tasks/t.jsonl"}])
    path = _write(tmp_path / "project" / "job.yaml", job)
    monkeypatch.chdir(tmp_path)  # not the job file's folder
    _, problems = validate_file(path, local=True)
    assert [(p.path, p.line) for p in problems] == [("spec.tasks[0].path", _line_of(path, "path: tasks"))]
    assert "tasks/t.jsonl: no such task file" in problems[0].message
    assert str(tmp_path / "project" / "tasks" / "t.jsonl") in problems[0].message
    (tmp_path / "project" / "tasks").mkdir()
    (tmp_path / "project" / "tasks" / "t.jsonl").write_text("{}\n")
    assert validate_file(path, local=True)[1] == []
    # The cluster (the operator) does not look for files on its own machine.
    assert validate_file(path)[1] == []


def _opd(teacher: str) -> dict:
    return _job(stages=[{"name": "sft", "type": "sft", "tasks": ["train"]},
                        {"name": "distil", "type": "opd", "tasks": ["train"],
                         "rl": {"teacher": teacher}}])


def test_a_teacher_typo_names_the_stage_it_is_near(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    path = _write(tmp_path / "job.yaml", _opd("sfft"))
    _, problems = validate_file(path, local=True)
    assert [(p.path, p.line) for p in problems] == [
        ("spec.stages[1].rl.teacher", _line_of(path, "teacher: sfft"))]
    assert "'sfft' is neither a stage of this job (sft, distil) nor a checkpoint directory" \
        in problems[0].message
    assert problems[0].message.endswith("did you mean 'sft'?")
    # Neither near a stage nor a checkpoint: the message says where it was looked for.
    _, problems = validate_file(_write(tmp_path / "job.yaml", _opd("teachers/m")), local=True)
    assert [p.path for p in problems] == ["spec.stages[1].rl.teacher"]
    assert str(tmp_path / "teachers" / "m") in problems[0].message
    # A checkpoint directory, relative to the working directory, or a stage: fine.
    checkpoint_config(tmp_path / "teachers")
    assert validate_file(_write(tmp_path / "job.yaml", _opd("teachers/m")), local=True)[1] == []
    assert validate_file(_write(tmp_path / "job.yaml", _opd("sft")), local=True)[1] == []
    # The job's own model, which spec.model.init makes before anything starts, may teach too.
    assert validate_file(_write(tmp_path / "job.yaml", _opd("m")), local=True)[1] == []
    assert validate_file(_write(tmp_path / "job.yaml", _opd(str(tmp_path / "m"))), local=True)[1] == []


def test_a_model_path_is_relative_to_the_working_directory(tmp_path, monkeypatch) -> None:
    job = _job(model={"path": "models/m"})
    path = _write(tmp_path / "jobs" / "job.yaml", job)
    monkeypatch.chdir(tmp_path)
    _, problems = validate_file(path, local=True)
    assert [p.path for p in problems] == ["spec.model.path"]
    checkpoint_config(tmp_path / "models")
    (job,), problems = validate_file(path, local=True)
    assert problems == []
    # `kiln run` reads them from the same places.
    assert resolve(job, path).spec.model.path == str(tmp_path / "models" / "m")


@pytest.mark.parametrize("name, why", [
    ("1job", "must start with a lowercase letter"),
    ("a" * (MAX_JOB_NAME + 1), f"has {MAX_JOB_NAME + 1} characters, at most {MAX_JOB_NAME} fit"),
])
def test_a_name_its_children_cannot_carry_is_refused_everywhere(name, why) -> None:
    text = yaml.safe_dump(_job(name=name), sort_keys=False)
    _, problems = validate_text(text, file="job.yaml")
    assert [(p.path, p.line) for p in problems] == [("metadata.name", 4)]
    assert why in problems[0].message
    spec, lines = parse_spec(name, _job()["spec"])  # what the operator reads
    assert spec is None and lines[0].startswith("metadata.name: ") and why in lines[0]


def test_every_child_of_the_longest_name_is_a_valid_object() -> None:
    name = "a" * MAX_JOB_NAME
    job = _job(name=name, trainer={"dataParallel": 2},
               stages=[{"name": "sft", "type": "sft", "tasks": ["train"]},
                       {"name": "distil", "type": "opd", "tasks": ["train"], "rl": {"teacher": "sft"}},
                       {"name": "kl", "type": "rl", "tasks": ["train"],
                        "rl": {"klCoef": 0.1, "reference": "sft"}}])
    (parsed,), problems = validate_text(yaml.safe_dump(job), file="job.yaml")
    assert problems == []
    children = desired_children(JobRef(name=name, namespace="ns", uid="u"), parsed.spec)
    assert any(c["metadata"]["name"].endswith("-trainer-replica") for c in children)
    for child in children:
        child_name, kind = child["metadata"]["name"], child["kind"]
        assert len(child_name) <= 63 and DNS_1035.match(child_name), child_name
        if kind == "StatefulSet":  # its pods' controller-revision-hash label: name-<10 chars>
            assert len(child_name) + 11 <= 63, child_name
    assert validate_text(yaml.safe_dump(_job(name="a" * MAX_JOB_NAME)), file="job.yaml")[1] == []
