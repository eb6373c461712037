"""The cluster example with a team's own task files (deploy/examples/cluster-tasks.yaml), run
exactly as its header says: the `#   kubectl ...` lines (a ConfigMap from the task files, the
output PVC), then plain `kubectl apply -f` of the job. On the development cluster it trains to
the end, evaluates the held-out set from the ConfigMap, and leaves each stage's Hugging Face
checkpoint on the output PVC, which `kiln export` copies out and `transformers` loads.

The API server is the fake one (no real one can run here); the operator, the pods' processes
and kubectl (1.31, `.tools/bin/kubectl`: newer ones send protobuf the fake API cannot read) are
real.
"""
from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
KUBECTL = REPO / ".tools" / "bin" / "kubectl"
KILN = Path(sys.executable).parent / "kiln"
EXAMPLE = "deploy/examples/cluster-tasks.yaml"

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not KUBECTL.exists(), reason="needs .tools/bin/kubectl")]


def header_commands() -> list[list[str]]:
    """The `#   kubectl ...` lines of the example's header, as argument lists."""
    out = []
    for line in (REPO / EXAMPLE).read_text().splitlines():
        if not line.startswith("#"):
            break
        if line.startswith("#   kubectl "):
            out.append(shlex.split(line[1:]))
    return out


def _kubectl(cluster: Path, *args: str) -> str:
    out = subprocess.run([str(KUBECTL), "--kubeconfig", str(cluster / "kubeconfig"), *args],
                         capture_output=True, text=True, timeout=60, cwd=REPO)
    assert out.returncode == 0, f"kubectl {' '.join(args)}: {out.stderr}"
    return out.stdout


def test_the_header_lists_what_the_job_needs() -> None:
    commands = header_commands()
    assert [c[:3] for c in commands] == [["kubectl", "create", "configmap"],
                                         ["kubectl", "apply", "-f"]]


def test_cluster_tasks_example_trains_from_a_configmap_and_writes_its_model_out(tmp_path) -> None:
    cluster = tmp_path / "cluster"
    subprocess.run([str(KILN), "dev-cluster", "up", str(cluster)], cwd=tmp_path, check=True,
                   timeout=120)
    try:
        for command in header_commands():
            _kubectl(cluster, *command[1:])
        _kubectl(cluster, "apply", "-f", EXAMPLE)

        def status() -> dict:
            return json.loads(_kubectl(cluster, "get", "rljob", "cluster-tasks", "-o",
                                       "json")).get("status") or {}
        deadline = time.monotonic() + 600
        while status().get("phase") not in ("Succeeded", "Failed"):
            if time.monotonic() > deadline:
                log = (cluster / "logs" / "operator.log").read_text()[-3000:]
                raise AssertionError(f"not finished in 10 minutes; status {status()}\n{log}")
            time.sleep(2)
        final = status()
        assert final["phase"] == "Succeeded", final
        assert final["finishedStages"] == ["sft", "rl"]
        assert final["startTime"] <= final["completionTime"]  # RFC 3339 UTC: ordered as text
        evaluations = final["evaluations"]
        assert set(evaluations) == {"rl/before/terminal-heldout", "rl/after/terminal-heldout"}
        assert all(e["tasks"] == 3 for e in evaluations.values())  # the ConfigMap's held-out set

        output = cluster / "pvc" / "default" / "kiln-results" / "cluster-tasks"
        summary = json.loads((output / "summary.json").read_text())
        assert set(summary["stages"]) == {"sft", "rl"} and summary["final_stage"] == "rl"
        assert summary["stages"]["rl"]["steps"] == 2
        # Beside it the trainer's report of the steps: the loss over both stages and more.
        assert {"loss.png", "reward.png", "staleness.png"} <= {p.name for p in (output / "report").iterdir()}
        # And the job's TensorBoard files: the trainer's steps, and the operator's driver's
        # held-out evaluations before and after the RL stage, which it sent the trainer.
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        trainer_board = EventAccumulator(str(output / "tensorboard"))
        trainer_board.Reload()
        assert "train/loss" in trainer_board.Tags()["scalars"]
        driver_board = EventAccumulator(str(output / "tensorboard" / "driver"))
        driver_board.Reload()
        assert len(driver_board.Scalars("eval/terminal-heldout/greedy_success")) == 2
        exported = tmp_path / "model"
        subprocess.run([str(KILN), "export", str(output), "--out", str(exported)], check=True,
                       timeout=120)
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(exported)
        assert model.config.hidden_size == 64
        assert AutoTokenizer.from_pretrained(exported).chat_template
    finally:
        subprocess.run([str(KILN), "dev-cluster", "down", str(cluster)], timeout=180)
