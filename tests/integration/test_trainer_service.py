"""The trainer service as a real process: readiness, a step over gRPC, metrics, checkpoint on
SIGTERM, resume on restart."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kiln.protos.kiln.v1 import trainer_pb2, trainer_pb2_grpc
from kiln.services.common.codec import to_proto
from kiln.services.common.tiny_model import make_tiny_checkpoint
from kiln.trajectory import Trajectory, VersionSpan

pytestmark = pytest.mark.slow


def _start(model_dir: Path, run_dir: Path) -> tuple[subprocess.Popen, dict]:
    ports = run_dir / "ports.json"
    ports.unlink(missing_ok=True)
    log = run_dir / "trainer.log"  # a file, not a pipe nobody drains while the test runs
    proc = subprocess.Popen(
        [sys.executable, "-m", "kiln.services.trainer.main", "--model-dir", str(model_dir),
         "--run-dir", str(run_dir), "--address", "127.0.0.1:0", "--metrics-port", "0",
         "--port-file", str(ports), "--threads", "1"],
        stdout=subprocess.DEVNULL, stderr=log.open("a"), env={**os.environ},
    )
    try:
        deadline = time.monotonic() + 60
        while not ports.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"trainer did not bind: {log.read_text()[-3000:]}")
            time.sleep(0.1)
        info = json.loads(ports.read_text())
        channel = grpc.insecure_channel(f"127.0.0.1:{info['port']}")
        health = health_pb2_grpc.HealthStub(channel)
        while health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status != \
                health_pb2.HealthCheckResponse.SERVING:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"trainer never became ready: {log.read_text()[-3000:]}")
            time.sleep(0.2)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    info["channel"] = channel
    return proc, info


def _stop(proc: subprocess.Popen) -> int:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_service_steps_exports_metrics_and_resumes(tmp_path: Path) -> None:
    model_dir = make_tiny_checkpoint(tmp_path / "m", hidden_size=64, intermediate_size=128)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    traj = Trajectory(id="t", task_id="x", group_id="g", tokens=[5, 6, 7, 8, 9, 10], loss_mask=[0, 0, 1, 1, 1, 1],
                      logp_infer=[0, 0, -5.9, -5.9, -5.9, -5.9], version_spans=[VersionSpan(2, 6, 0)])
    proc, info = _start(model_dir, run_dir)
    try:
        stub = trainer_pb2_grpc.TrainerStub(info["channel"])
        r = stub.TrainStep(trainer_pb2.TrainStepRequest(trajectories=[to_proto(traj)], kind=trainer_pb2.STEP_KIND_SFT),
                           timeout=60)
        assert r.step == 1 and r.metrics["tokens"] == 4
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{info['metrics_port']}/metrics", timeout=5).read().decode()
        loss_line = next(line for line in metrics.splitlines() if line.startswith('kiln_train_loss{stage="sft"}'))
        assert float(loss_line.split()[-1]) == pytest.approx(r.metrics["loss"])
        assert 'kiln_policy_version{component="trainer"} 0.0' in metrics
        info["channel"].close()
    finally:
        code = _stop(proc)
    assert code == 0
    assert (run_dir / "checkpoints" / "step_00000001" / "meta.json").exists()

    proc, info = _start(model_dir, run_dir)
    try:
        status = trainer_pb2_grpc.TrainerStub(info["channel"]).GetTrainerStatus(trainer_pb2.TrainerStatusRequest(), timeout=10)
        assert status.step == 1 and status.last_checkpoint.endswith("step_00000001")
        assert status.last_metrics["loss"] == pytest.approx(r.metrics["loss"])
        info["channel"].close()
    finally:
        assert _stop(proc) == 0


def test_bad_configuration_exits_with_a_message(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kiln.services.trainer.main", "--model-dir", str(tmp_path / "missing"),
         "--run-dir", str(tmp_path), "--address", "127.0.0.1:0", "--metrics-port", "0"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2 and "has no config.json" in proc.stderr
