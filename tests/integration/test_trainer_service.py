"""The trainer service as a real process, on the path training really takes: RunStage pulls
leased batches from a real buffer process, steps, acks and publishes through a real weight-sync
process; metrics are exported; SIGTERM writes a checkpoint and a restart resumes from it."""
from __future__ import annotations

import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from kiln.models.tiny import make_tiny_checkpoint
from kiln.services.buffer.client import GrpcBufferClient
from kiln.services.trainer.client import TrainerClient
from kiln.trajectory import Trajectory, VersionSpan

from helpers.services import start_service, stop_service, trainer_serving, wait_for

pytestmark = pytest.mark.slow

JOB = """
apiVersion: kiln.dev/v1alpha1
kind: RLJob
metadata: {{name: trainer-svc}}
spec:
  model: {{path: "{model}", dtype: float32}}
  tasks: [{{name: t, env: chain, generate: {{count: 10}}}}]
  stages:
    - {{name: warmup, type: sft, tasks: [t], maxSteps: 2, batchSize: 2, microBatchSize: 2,
       learningRate: 1.0e-3}}
  trainer: {{checkpointInterval: 100}}
"""


def _traj(i: int) -> Trajectory:
    tokens = [5 + (i + k) % 250 for k in range(8)]
    return Trajectory(id=f"t{i}", task_id="x", group_id="", tokens=tokens, loss_mask=[0, 0] + [1] * 6,
                      logp_infer=[0.0] * 8, version_spans=[VersionSpan(2, 8, 0)])


def test_service_runs_a_stage_exports_metrics_and_resumes(tmp_path: Path) -> None:
    model_dir = make_tiny_checkpoint(tmp_path / "m", hidden_size=64, intermediate_size=128)
    job = tmp_path / "job.yaml"
    job.write_text(JOB.format(model=model_dir))
    procs = []
    try:
        # A bound until the stage configures the buffer (SFT: none), so that is observable.
        buf_proc, buf = start_service("buffer", tmp_path / "buffer", job, {}, ["--tau", "3"])
        procs.append(buf_proc)
        ws_proc, ws = start_service("weight_sync", tmp_path / "weight_sync", job)
        procs.append(ws_proc)
        env = {"KILN_BUFFER_ADDR": f"127.0.0.1:{buf['port']}",
               "KILN_WEIGHT_SYNC_ADDR": f"127.0.0.1:{ws['port']}"}
        buffer = GrpcBufferClient(env["KILN_BUFFER_ADDR"])
        proc, info = start_service("trainer", tmp_path / "trainer", job, env, ["--threads", "1"])
        trainer = TrainerClient(f"127.0.0.1:{info['port']}")
        wait_for("trainer ready", lambda: trainer_serving(trainer))
        trainer.start_stage("warmup")
        wait_for("the stage configured the buffer", lambda: buffer.status().tau is None)
        buffer.put([_traj(i) for i in range(4)], group_size=1)
        status = wait_for("stage done", lambda: (s := trainer.status()).stage_done and s)
        assert (status.stage_step, status.step, status.policy_version) == (2, 2, 1)
        assert buffer.status().served == 4
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{info['metrics_port']}/metrics",
                                         timeout=5).read().decode()
        loss_line = next(line for line in metrics.splitlines()
                         if line.startswith('kiln_train_loss{stage="warmup"}'))
        assert float(loss_line.split()[-1]) == pytest.approx(status.last_step.loss)
        assert 'kiln_policy_version{component="trainer"} 1.0' in metrics
        trainer.close()
        assert stop_service(proc) == 0
        assert (tmp_path / "trainer" / "checkpoints" / "step_00000002" / "meta.json").exists()

        # Weight-sync moved on while the trainer was down (versions published after its last
        # checkpoint, lost with it): the restarted trainer takes the next version, with its
        # own weights, instead of having every publish refused as stale.
        import asyncio

        import grpc
        import torch

        from kiln.services.weight_sync.client import publish
        from kiln.services.weight_sync.client import status as ws_status

        async def leap() -> None:
            async with grpc.aio.insecure_channel(env["KILN_WEIGHT_SYNC_ADDR"]) as ch:
                await publish(ch, 5, [("w", torch.zeros(4))], 1 << 20)

        asyncio.run(leap())
        proc, info = start_service("trainer", tmp_path / "trainer", job, env, ["--threads", "1"])
        trainer = TrainerClient(f"127.0.0.1:{info['port']}")
        wait_for("trainer ready again", lambda: trainer_serving(trainer))
        status = trainer.status()
        assert (status.step, status.policy_version) == (2, 6)

        async def latest() -> int:
            async with grpc.aio.insecure_channel(env["KILN_WEIGHT_SYNC_ADDR"]) as ch:
                return int((await ws_status(ch)).policy_version)

        assert asyncio.run(latest()) == 6
        assert status.last_checkpoint.endswith("step_00000002")
        assert status.last_step.loss == pytest.approx(float(loss_line.split()[-1]))
        trainer.close()
        buffer.close()
        assert stop_service(proc) == 0
    finally:
        for p in procs:
            stop_service(p)


def test_bad_configuration_exits_with_a_message(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kiln.services.trainer.main", "--model-dir", str(tmp_path / "missing"),
         "--run-dir", str(tmp_path), "--address", "127.0.0.1:0", "--metrics-port", "0"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2 and "has no config.json" in proc.stderr
