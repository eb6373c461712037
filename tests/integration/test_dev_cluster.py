"""An RLJob applied with kubectl trains to the end on the development cluster: the real
operator drives the stages over gRPC against real services that the node agent runs as
processes, including a distillation stage whose teacher (the SFT stage's weights) is a frozen
deployment the operator starts when that stage is done. Mid-run the operator is killed and started again (the job carries on from its status)
and a child Deployment is deleted (the operator puts it back). The API server is the fake one
(no real one can run here); everything else is real.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
KUBECTL = REPO / ".tools" / "bin" / "kubectl"
KILN = Path(sys.executable).parent / "kiln"

pytestmark = pytest.mark.slow


def _job(tmp: Path) -> Path:
    job = yaml.safe_load((REPO / "deploy" / "examples" / "quickstart.yaml").read_text())
    spec = job["spec"]
    job["metadata"]["name"] = "dc"
    spec["model"]["path"] = "model"  # relative: the pods run in the folder `up` ran in
    spec["model"]["init"].update(hiddenSize=64, numLayers=1, numHeads=2, numKvHeads=1,
                                 intermediateSize=128)
    spec["tasks"][0]["generate"]["count"] = 300
    spec["tasks"][1]["generate"]["count"] = 8
    sft, rl = spec["stages"]
    sft.update(maxSteps=60, batchSize=16, microBatchSize=16, warmupSteps=0)
    rl.update(maxSteps=4, batchSize=16, microBatchSize=16)
    rl["rl"].update(groupSize=4, tau=1)
    # On-policy distillation from the SFT stage's weights: a frozen deployment of the operator's.
    spec["stages"].append({"name": "distil", "type": "rl", "tasks": ["chain-train"], "maxSteps": 2,
                           "batchSize": 16, "microBatchSize": 16,
                           "rl": {"advantage": "opd", "teacher": "sft", "groupSize": 4, "tau": 1}})
    spec["rollout"].update(maxConcurrentEpisodes=32, sampleEvery=1)
    spec["sandbox"]["maxConcurrent"] = 32
    path = tmp / "job.yaml"
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return path


def _kubectl(cluster: Path, *args: str) -> str:
    out = subprocess.run([str(KUBECTL), "--kubeconfig", str(cluster / "kubeconfig"), *args],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


def _status(cluster: Path) -> dict:
    return json.loads(_kubectl(cluster, "get", "rljob", "dc", "-o", "json")).get("status") or {}


def _wait(what: str, check, timeout: float, cluster: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(1)
    log = (cluster / "logs" / "operator.log").read_text()[-3000:]
    raise AssertionError(f"timed out waiting for {what}; status {_status(cluster)}\n{log}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def test_applied_job_trains_to_the_end_through_operator_restart_and_child_deletion(tmp_path):
    cluster = tmp_path / "cluster"
    job = _job(tmp_path)
    up = [str(KILN), "dev-cluster", "up", str(cluster)]
    subprocess.run(up, cwd=tmp_path, check=True, timeout=120)
    pids: set[int] = set()
    try:
        _kubectl(cluster, "apply", "-f", str(job))
        _wait("the trainer in stage sft", lambda: _status(cluster).get("stage") == "sft", 600,
              cluster)
        pids = {int(p) for p in (cluster / "pods.pids").read_text().split()}
        assert len(pids) >= 5  # a process per service at least

        # A child goes missing mid-stage; the operator's timer puts it back.
        uid = json.loads(_kubectl(cluster, "get", "deployment", "dc-weight-sync", "-o",
                                  "json"))["metadata"]["uid"]
        _kubectl(cluster, "delete", "deployment", "dc-weight-sync")

        def restored() -> bool:
            out = subprocess.run([str(KUBECTL), "--kubeconfig", str(cluster / "kubeconfig"),
                                  "get", "deployment", "dc-weight-sync", "-o", "json"],
                                 capture_output=True, text=True, timeout=60)
            return out.returncode == 0 and json.loads(out.stdout)["metadata"]["uid"] != uid
        _wait("dc-weight-sync restored", restored, 60, cluster)
        _wait("the repair logged", lambda: "repaired Deployment/dc-weight-sync (created)" in (
            cluster / "logs" / "operator.log").read_text(), 30, cluster)

        # The operator dies mid-run; a second `up` starts only it again.
        assert _status(cluster)["phase"] == "Running"
        os.killpg(int((cluster / "operator.pid").read_text()), signal.SIGKILL)
        cluster_pid = int((cluster / "cluster.pid").read_text())
        subprocess.run(up, cwd=tmp_path, check=True, timeout=120)
        assert int((cluster / "cluster.pid").read_text()) == cluster_pid

        _wait("phase Succeeded", lambda: _status(cluster).get("phase") in ("Succeeded", "Failed"),
              900, cluster)
        status = _status(cluster)
        assert status["phase"] == "Succeeded", status
        assert status["finishedStages"] == ["sft", "rl", "distil"]
        evaluations = status["evaluations"]
        assert set(evaluations) == {"rl/before/chain-heldout", "rl/after/chain-heldout"}
        for result in evaluations.values():
            assert 0.0 <= result["greedySuccess"] <= 1.0 and result["tasks"] == 8
        # RL trained between the two evaluations (one published version per step).
        assert (evaluations["rl/after/chain-heldout"]["policyVersion"]
                == evaluations["rl/before/chain-heldout"]["policyVersion"] + 4)
        assert {"Driving": "Completed", "Valid": "Accepted"}.items() <= {
            c["type"]: c["reason"] for c in status["conditions"]}.items()
        assert status["startTime"] <= status["completionTime"]  # RFC 3339, both in UTC
        pids |= {int((cluster / f"{n}.pid").read_text()) for n in ("cluster", "operator")}

        # The teacher pod fetched the SFT stage's weights from the trainer, byte for byte, and
        # scored every distillation trajectory on its trained tokens.
        pods = cluster / "pods" / "default"
        export = cluster / "pvc" / "default" / "dc-checkpoints" / "stages" / "sft"
        fetched = pods / "dc-teacher-0" / "volumes" / "run" / "teacher"
        files = sorted(p.relative_to(export) for p in export.rglob("*") if p.is_file())
        assert "config.json" in {str(f) for f in files}
        assert files == sorted(p.relative_to(fetched) for p in fetched.rglob("*") if p.is_file())
        assert all((export / f).read_bytes() == (fetched / f).read_bytes() for f in files)
        assert "weights fetched" in "".join(
            p.read_text() for p in (pods / "dc-teacher-0" / "logs").glob("*.log"))
        kept = [json.loads(line) for line in
                (pods / "dc-rollout-0" / "volumes" / "run" / "trajectories.jsonl").read_text().splitlines()]
        distilled = [t for t in kept if t["stage"] == "distil"]
        assert distilled and all(
            all(v < 0 for v, m in zip(t["teacher_logp"], t["loss_mask"]) if m) for t in distilled)
        assert all(not t["teacher_logp"] for t in kept if t["stage"] != "distil")

        # The operator's driver tracked the job as `kiln run`'s does (both operator processes,
        # before and after the kill): the two evaluations and the progress to the last step.
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        tracked = EventAccumulator(str(cluster / "tracking" / "default" / "dc" / "driver"))
        tracked.Reload()
        assert len(tracked.Scalars("eval/chain-heldout/greedy_success")) == 2
        assert tracked.Scalars("progress/steps_left")[-1].value == 0
    finally:
        subprocess.run([str(KILN), "dev-cluster", "down", str(cluster)], timeout=180)
    # Nothing stays behind: the agent, the operator and every pod process are gone.
    assert not [p for p in pids if _alive(p)]
    assert not (cluster / "kubeconfig").exists()
