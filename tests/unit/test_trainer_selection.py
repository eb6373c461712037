"""The trainer's side of the guard rails on a tiny model: a guarded RL stage waits at every
evaluated step with its weights published and checkpointed, the best checkpoint survives
`keepCheckpoints` pruning, and a restore ends the stage with that step's weights: published as
a new version, exported as the stage's (what the next stage and final-hf start from), and
reported done after a restart."""
from __future__ import annotations

import random
import threading
import time
from pathlib import Path

import pytest
import torch

from kiln.api.validate import load_job
from kiln.models.hf_io import read_hf_state_dict
from kiln.models.tiny import make_tiny_checkpoint
from kiln.services.buffer.buffer import TrajectoryBuffer
from kiln.services.buffer.client import InProcessBufferClient
from kiln.services.buffer.types import BufferConfig
from kiln.services.trainer import checkpoint as ckpt
from kiln.services.trainer.config import config_from_job
from kiln.services.trainer.engine import TrainerEngine
from kiln.services.trainer.loop import InMemoryPublisher
from kiln.services.trainer.stages import StageRunner, stage_export_dir
from kiln.trajectory import Trajectory, VersionSpan

JOB = """
apiVersion: kiln.dev/v1alpha1
kind: RLJob
metadata: {{name: selection}}
spec:
  model: {{path: "{model}", dtype: float32}}
  tasks:
    - {{name: t, env: chain, generate: {{count: 10}}}}
    - {{name: h, env: chain, generate: {{count: 4, split: heldout}}}}
  stages:
    - {{name: rl, type: rl, tasks: [t], maxSteps: 4, batchSize: 2, microBatchSize: 2,
       learningRate: 5.0e-2, rl: {{groupSize: 2, tau: 100}},
       eval: {{tasks: [h], every: 1, select: {{}}, stopOnRegression: {{drop: 0.1}}}}}}
  trainer: {{checkpointInterval: 100, keepCheckpoints: 1}}
"""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("sel") / "m", hidden_size=64,
                                intermediate_size=128)


def _group(i: int) -> list[Trajectory]:
    rng = random.Random(i)
    tokens = [rng.randrange(4, 300) for _ in range(10)]
    return [Trajectory(id=f"t{i}-{k}", task_id=f"x{i}", group_id=f"g{i}", tokens=tokens,
                       loss_mask=[0, 0] + [1] * 8, logp_infer=[0.0, 0.0] + [-5.7] * 8,
                       version_spans=[VersionSpan(2, 10, 0)], reward=float(k))
            for k in range(2)]


def _wait(what, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_the_best_checkpoint_is_kept_and_restored(model_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "job.yaml").write_text(JOB.format(model=model_dir))
    job = load_job(tmp_path / "job.yaml")
    engine = TrainerEngine(config_from_job(job, run_dir=tmp_path))
    buffer = InProcessBufferClient(TrajectoryBuffer.open(tmp_path / "buffer", BufferConfig()))
    publisher = InMemoryPublisher(keep_all=True)
    runner = StageRunner(job, engine, threading.Lock(), buffer, publisher, tmp_path)
    root = tmp_path / "checkpoints"
    try:
        runner.start("rl")
        _wait(lambda: buffer.status().tau == 100)  # configured for the stage
        for i in range(4):
            buffer.put(_group(i), group_size=2)
        # Step 1: waits, its weights published (the version rollout would evaluate) and kept.
        _wait(lambda: runner.status.eval_step == 1)
        assert engine.stage_steps["rl"] == 1 and not runner.status.done
        # keepCheckpoints 1, and yet step 0 (the stage's start, not judged yet) is still there.
        assert [ckpt.checkpoint_step(p) for p in ckpt.list_checkpoints(root)] == [0, 1]
        best = {n: t.clone() for n, t in publisher.latest.items()}
        time.sleep(0.2)
        assert engine.stage_steps["rl"] == 1  # still waiting
        runner.continue_stage("rl", 1, keep_step=1)
        _wait(lambda: runner.status.eval_step == 2)
        runner.continue_stage("rl", 2, keep_step=1)  # step 2 scored lower: 1 stays the best
        _wait(lambda: runner.status.eval_step == 3)
        # keepCheckpoints 1 pruned step 0 and step 2, not the best one.
        kept = [ckpt.checkpoint_step(p) for p in ckpt.list_checkpoints(root)]
        assert kept == [1, 3], kept
        changed = publisher.latest
        assert any(not torch.equal(changed[n], best[n]) for n in best)
        # A regression: end the stage with step 1's weights.
        status = runner.restore("rl", 1, "stopped on regression (test)")
        assert status.done and status.selected_step == 1 and not runner._thread.is_alive()
        assert engine.stage_steps["rl"] == 3 and engine.step_count == 3
        published = publisher.latest  # a new version, step 1's weights
        assert publisher.versions[-1] == engine.policy_version == 4  # v1-v3 at steps 1-3
        assert all(torch.equal(published[n], best[n]) for n in best)
        exported = read_hf_state_dict(stage_export_dir(tmp_path, "rl"))
        assert all(torch.equal(exported[n], best[n]) for n in best)
        # The latest checkpoint holds them too: a restart resumes from the selected weights.
        assert ckpt.checkpoint_step(ckpt.latest_checkpoint(root)) == 3
        # Idempotent, and a restarted trainer reports the stage done on its selected step.
        assert runner.restore("rl", 1, "again").selected_reason == "stopped on regression (test)"
        restarted = TrainerEngine(config_from_job(job, run_dir=tmp_path))
        assert restarted.policy_version == 4
        assert all(torch.equal(t, best[n]) for n, t in restarted.named_hf_tensors())
        again = StageRunner(job, restarted, threading.Lock(), buffer, publisher, tmp_path)
        st = again.start("rl")
        assert st.done and st.selected_step == 1 and again._thread is None
        with pytest.raises(ValueError, match="step 2 .* is gone"):
            runner.restore("rl", 2, "pruned")
    finally:
        runner.stop()
        buffer.close()
