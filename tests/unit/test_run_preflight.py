"""`kiln run`'s pre-flight (`kiln.cli.local.preflight`): a run refused before it starts writes no
`RUN_DIR/job.yaml` (so the same command, run again once fixed, is not taken for a second run),
and `--resume RUN_DIR JOB` runs the edited job, saying what changed, unless what changed cannot
change on a running job."""
from __future__ import annotations

import argparse
import io
from pathlib import Path

import pytest
import yaml

from helpers.capabilities import checkpoint_config
from helpers.fake_hub import FakeHub
from kiln.cli.local.preflight import prepare


def _job(model: dict, **stage) -> dict:
    return {"apiVersion": "kiln.dev/v1alpha1", "kind": "RLJob", "metadata": {"name": "pre"},
            "spec": {"model": model,
                     "tasks": [{"name": "train", "env": "chain", "generate": {"count": 4}}],
                     "stages": [{"name": "sft", "type": "sft", "tasks": ["train"], **stage}]}}


def _args(job: Path | None = None, run_dir: Path | None = None, resume: Path | None = None):
    return argparse.Namespace(job=job, run_dir=run_dir, resume=resume)


def _prepare(args) -> tuple[object, str, str]:
    out, err = io.StringIO(), io.StringIO()
    return prepare(args, out, err), out.getvalue(), err.getvalue()


def test_a_refused_pre_flight_writes_no_job_file(tmp_path, monkeypatch) -> None:
    hub = FakeHub({})  # the repository the job names is not there: not worth retrying
    monkeypatch.setenv("HF_ENDPOINT", hub.start())
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(_job({"path": str(tmp_path / "m"), "hub": {"id": "org/gone"}})))
    run = tmp_path / "run"
    code, _, err = _prepare(_args(job, run))
    assert code == 1 and "no repository 'org/gone'" in err
    assert not (run / "job.yaml").exists()
    # Fixed, the same command runs: not refused as "holds a previous run".
    model = checkpoint_config(tmp_path)
    job.write_text(yaml.safe_dump(_job({"path": str(model)})))
    _, run_dir = _prepare(_args(job, run))[0]
    assert run_dir == run.resolve() and (run / "job.yaml").exists()
    code, _, err = _prepare(_args(job, run))
    assert code == 1 and "holds a previous run" in err


@pytest.fixture()
def started(tmp_path: Path) -> tuple[Path, Path, dict]:
    """A run directory a run started from `job.yaml` left, and that job."""
    data = _job({"path": str(checkpoint_config(tmp_path))}, maxSteps=10)
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(data))
    run = tmp_path / "run"
    assert not isinstance(_prepare(_args(job, run))[0], int)
    return job, run, data


def test_resume_with_an_edited_job_runs_it_and_says_what_changed(started) -> None:
    job, run, data = started
    code, out, _ = _prepare(_args(resume=run))
    assert not isinstance(code, int) and "resuming" not in out  # no job file given
    code, out, _ = _prepare(_args(job, resume=run))
    assert not isinstance(code, int) and out.endswith(": no changes\n")
    data["spec"]["stages"][0]["maxSteps"] = 20
    job.write_text(yaml.safe_dump(data))
    (resumed, run_dir), out, _ = _prepare(_args(job, resume=run))
    assert resumed.spec.stages[0].max_steps == 20
    assert "spec.stages[0].maxSteps: 10 -> 20" in out
    assert yaml.safe_load((run / "job.yaml").read_text())["spec"]["stages"][0]["maxSteps"] == 20


@pytest.mark.parametrize("field, change", [
    ("spec.model.path", lambda d, tmp: d["spec"]["model"].update(path=str(checkpoint_config(tmp / "other")))),
    ("spec.trainer.dataParallel", lambda d, tmp: d["spec"].update(trainer={"dataParallel": 2})),
    ("metadata.name", lambda d, tmp: d["metadata"].update(name="other")),
])
def test_resume_refuses_what_a_running_job_cannot_change(started, tmp_path, field, change) -> None:
    job, run, data = started
    saved = (run / "job.yaml").read_text()
    change(data, tmp_path)
    job.write_text(yaml.safe_dump(data))
    code, _, err = _prepare(_args(job, resume=run))
    assert code == 1 and f"these cannot change: {field}: " in err
    assert (run / "job.yaml").read_text() == saved
