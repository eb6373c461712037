"""Parallel trainers through the service: the same SFT stage, fed by a real buffer process and
publishing through a real weight-sync process, run by one rank, by a TP=2 trainer (the
service starts its second rank itself) and by two DP replicas (two `kiln-trainer` processes,
as two pods would run). The loss and gradient norm of every run and the final weights must
equal the single-rank run's within float32 reduction-order tolerance."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kiln.models.parallel import free_port
from kiln.models.tiny import make_tiny_checkpoint
from kiln.services.buffer.client import GrpcBufferClient
from kiln.services.trainer.client import TrainerClient
from kiln.trajectory import Trajectory, VersionSpan
from helpers.services import start_service, stop_service, trainer_serving, wait_for

pytestmark = pytest.mark.slow

JOB = """
apiVersion: kiln.dev/v1alpha1
kind: RLJob
metadata: {{name: trainer-parallel}}
spec:
  model: {{path: "{model}", dtype: float32}}
  tasks: [{{name: t, env: chain, generate: {{count: 10}}}}]
  stages:
    - {{name: sft, type: sft, tasks: [t], maxSteps: 2, batchSize: 6, microBatchSize: 2,
       learningRate: 1.0e-3}}
  trainer: {{tensorParallel: {tp}, dataParallel: {dp}, checkpointInterval: 100, gradClip: 0.5}}
"""

# Float32 sums in a different order (TP's split matmuls and gathered norms, DP's gradient sum
# over replicas); two AdamW steps at lr 1e-3 move a weight by at most 2e-3.
LOSS_RTOL = 1e-5
WEIGHT_ATOL = 2e-5


def _trajectories() -> list[Trajectory]:
    g = torch.Generator().manual_seed(7)
    out = []
    for i in range(12):
        n = 6 + i % 5  # uneven lengths: padding and the DP split both matter
        tokens = torch.randint(5, 250, (n,), generator=g).tolist()
        out.append(Trajectory(id=f"t{i}", task_id="x", group_id="", tokens=tokens,
                              loss_mask=[0, 0] + [1] * (n - 2), logp_infer=[0.0] * n,
                              version_spans=[VersionSpan(2, n, 0)]))
    return out


def _run(tmp: Path, model_dir: Path, tp: int, dp: int) -> tuple[dict, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    job = tmp / "job.yaml"
    tmp.mkdir(parents=True)
    job.write_text(JOB.format(model=model_dir, tp=tp, dp=dp))
    procs = []
    try:
        # A bound until the stage configures the buffer (SFT: none), so that is observable.
        buf_proc, buf = start_service("buffer", tmp / "buffer", job, {}, ["--tau", "3"])
        procs.append(buf_proc)
        ws_proc, ws = start_service("weight_sync", tmp / "weight_sync", job)
        procs.append(ws_proc)
        env = {"KILN_BUFFER_ADDR": f"127.0.0.1:{buf['port']}",
               "KILN_WEIGHT_SYNC_ADDR": f"127.0.0.1:{ws['port']}"}
        if dp > 1:
            env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        trainers = []
        for replica in range(dp):
            renv = {**env, "KILN_TRAINER_REPLICA": str(replica)} if dp > 1 else env
            proc, info = start_service("trainer", tmp / f"trainer-{replica}", job, renv, ["--threads", "1"])
            procs.append(proc)
            trainers.append((proc, info))
        trainer = TrainerClient(f"127.0.0.1:{trainers[0][1]['port']}")
        wait_for("trainer ready", lambda: trainer_serving(trainer), timeout=180)
        buffer = GrpcBufferClient(env["KILN_BUFFER_ADDR"])
        trainer.start_stage("sft")
        wait_for("the stage configured the buffer", lambda: buffer.status().tau is None)
        buffer.put(_trajectories(), group_size=1)
        status = wait_for("stage done", lambda: (s := trainer.status()).stage_done and s, timeout=180)
        assert not status.stage_failed, status.message
        assert (status.step, status.policy_version) == (2, 1)
        assert status.tensor_parallel == tp
        trainer.close()
        buffer.close()
        # Replica 0 first: it releases the other replicas after its final checkpoint, and
        # they exit on their own.
        assert stop_service(trainers[0][0]) == 0
        for proc, _ in trainers[1:]:
            assert proc.wait(timeout=60) == 0
        weights = load_file(str(tmp / "trainer-0" / "stages" / "sft" / "model.safetensors"))
        # Only replica 0 keeps checkpoints and exports.
        assert not any((tmp / f"trainer-{r}" / "stages").exists() for r in range(1, dp))
        assert (tmp / "trainer-0" / "checkpoints" / "step_00000002" / "meta.json").exists()
        return status.last_step, weights
    finally:
        for p in procs:
            if p.poll() is None:
                stop_service(p)


def test_tp2_and_dp2_match_one_rank(tmp_path: Path) -> None:
    model_dir = make_tiny_checkpoint(tmp_path / "m", hidden_size=64, intermediate_size=128)
    base_m, base_w = _run(tmp_path / "tp1", model_dir, 1, 1)
    assert base_m.loss > 0 and base_m.grad_norm > 0.5  # the clip acts on these steps
    for tp, dp in ((2, 1), (1, 2)):
        m, w = _run(tmp_path / f"tp{tp}-dp{dp}", model_dir, tp, dp)
        for key in ("loss", "grad_norm", "sequences"):
            assert getattr(m, key) == pytest.approx(getattr(base_m, key), rel=LOSS_RTOL), (tp, dp, key)
        assert w.keys() == base_w.keys()
        worst = max((w[k] - base_w[k]).abs().max().item() for k in w)
        assert worst <= WEIGHT_ATOL, (tp, dp, worst)
        print(f"tp={tp} dp={dp}: loss {m.loss:.8f} vs {base_m.loss:.8f}, "
              f"max |weight difference| {worst:.2e}")
