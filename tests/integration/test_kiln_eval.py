"""`kiln eval` end to end: a tiny checkpoint (the cut-down quickstart's model, untrained), the
real sandbox and rollout services and engine, and the eval.json it writes: its structure, its
pass@k recomputed from its own per-task counts, pass@1 = mean@N, pass@k not falling with k,
and no service left running afterwards."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml

from kiln.evaluation import pass_at_k

from helpers.kiln_run import cut_down_job

pytestmark = pytest.mark.slow

SAMPLES, TASKS = 4, 6


def _kiln(*args, cwd, timeout=600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kiln.cli.main", *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, timeout=timeout)


def test_kiln_eval_writes_pass_at_k_from_its_counts(tmp_path):
    job = cut_down_job(tmp_path)
    model = yaml.safe_load(job.read_text())["spec"]["model"]["path"]
    made = _kiln("prepare-model", job, cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    out = tmp_path / "eval"
    res = _kiln("eval", job, model, "--task-set", "chain-heldout", "--samples", SAMPLES,
                "--max-tasks", TASKS, "--out", out, cwd=tmp_path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    report = json.loads((out / "eval.json").read_text())

    assert {"pass_at_k", "mean_at_n", "greedy", "tasks", "model", "job", "task_set",
            "samples"} <= set(report)
    assert (report["task_set"], report["samples"]) == ("chain-heldout", SAMPLES)
    tasks = report["tasks"]
    assert len(tasks) == TASKS and len({t["id"] for t in tasks}) == TASKS
    assert all(t["samples"] == SAMPLES and 0 <= t["successes"] <= SAMPLES for t in tasks)
    assert all(isinstance(t["greedy"], bool) for t in tasks)
    assert list(report["pass_at_k"]) == ["1", "2", "4"]
    for k, value in report["pass_at_k"].items():
        want = sum(pass_at_k(SAMPLES, t["successes"], int(k)) for t in tasks) / TASKS
        assert value == pytest.approx(want)
    assert report["pass_at_k"]["1"] == pytest.approx(report["mean_at_n"])
    values = list(report["pass_at_k"].values())
    assert values == sorted(values)
    assert report["greedy"] == pytest.approx(sum(t["greedy"] for t in tasks) / TASKS)

    # Every service it started has exited (each wrote its pid into its port file).
    for ports in (out / "services").glob("*/ports.json"):
        pid = json.loads(ports.read_text())["pid"]
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_kiln_eval_refuses_an_unknown_task_set(tmp_path):
    job = cut_down_job(tmp_path)
    res = _kiln("eval", job, tmp_path, "--task-set", "nope", "--out", tmp_path / "e",
                cwd=tmp_path, timeout=120)
    assert res.returncode == 1
    assert "--task-set: 'nope' is not a task set of the job" in res.stderr
    assert not (tmp_path / "e").exists()
