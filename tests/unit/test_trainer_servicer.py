"""The Trainer gRPC servicer over a real in-process server and channel, driving the real stage
path: RunStage starts the stage runner, which pulls leased batches from a real buffer (in this
process), steps the engine, acks and publishes; GetTrainerStatus follows it."""
from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from pathlib import Path

import grpc
import pytest

from kiln.api.validate import load_job
from kiln.control.clients import TrainerControlClient
from kiln.cli.main import main
from kiln.models.tiny import make_tiny_checkpoint
from kiln.protos.kiln.v1 import trainer_pb2, trainer_pb2_grpc
from kiln.services.buffer.buffer import TrajectoryBuffer
from kiln.services.buffer.types import BufferConfig
from kiln.services.buffer.client import InProcessBufferClient
from kiln.services.common.server import Registration, create_server
from kiln.services.trainer.config import config_from_job
from kiln.services.trainer.engine import TrainerEngine
from kiln.services.trainer import metrics as trainer_metrics
from kiln.services.trainer.loop import InMemoryPublisher
from kiln.services.trainer.servicer import SERVICE_NAME, TrainerServicer, add_to_server
from kiln.services.trainer.client import TrainerClient
from kiln.services.trainer.stages import StageRunner, stage_export_dir
from kiln.services.trainer.wire import ExportError, ExportWriter, export_chunks
from kiln.tracking import Tracker
from kiln.trajectory import Trajectory, VersionSpan

JOB = """
apiVersion: kiln.dev/v1alpha1
kind: RLJob
metadata: {{name: servicer}}
spec:
  model: {{path: "{model}", dtype: float32}}
  tasks: [{{name: t, env: chain, generate: {{count: 10}}}}]
  stages:
    - {{name: warmup, type: sft, tasks: [t], maxSteps: 3, batchSize: 2, microBatchSize: 2,
       learningRate: 1.0e-3}}
  trainer: {{checkpointInterval: 100}}
"""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("svc") / "m", hidden_size=64, intermediate_size=128)


def _job(model_dir: Path, tmp_path: Path):
    path = tmp_path / "job.yaml"
    path.write_text(JOB.format(model=model_dir))
    return load_job(path)


def _traj(i: int) -> Trajectory:
    rng = random.Random(i)
    tokens = [rng.randrange(4, 300) for _ in range(9)]
    return Trajectory(id=f"t{i}", task_id="x", group_id="", tokens=tokens, loss_mask=[0] * 3 + [1] * 6,
                      logp_infer=[0.0] * 9, version_spans=[VersionSpan(3, 9, 0)])


def test_run_stage_trains_through_the_buffer_and_reports(model_dir: Path, tmp_path: Path,
                                                         capsys) -> None:
    job = _job(model_dir, tmp_path)
    engine = TrainerEngine(config_from_job(job, run_dir=tmp_path))
    # A bound until the stage configures the buffer (SFT: none), so that is observable.
    buffer = InProcessBufferClient(TrajectoryBuffer.open(tmp_path / "buffer", BufferConfig(tau=3)))
    publisher = InMemoryPublisher()
    lock = threading.Lock()
    # The job's output folder (spec.output): each stage's model goes there too, and the job's
    # TensorBoard files (the trainer's, and the driver's it is sent).
    tracker = Tracker(tmp_path / "tensorboard", run_name="trainer", group="servicer")
    stages = StageRunner(job, engine, lock, buffer, publisher, tmp_path, tracker,
                         output_dir=tmp_path / "out")
    servicer = TrainerServicer(engine, lock, stages)
    # The tau series of an earlier RL stage, which this supervised stage (no bound) removes.
    trainer_metrics.observe_stage_tau("earlier-rl", 4)

    async def scenario() -> None:
        server, port = await create_server("127.0.0.1:0", [Registration(add_to_server, servicer, SERVICE_NAME)])
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        stub = trainer_pb2_grpc.TrainerStub(channel)
        try:
            started = await stub.RunStage(trainer_pb2.RunStageRequest(stage="warmup"))
            assert started.stage_max_steps == 3 and not started.stage_done
            # Its weights are not there to fetch before it ends.
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in stub.FetchStageExport(trainer_pb2.FetchStageExportRequest(stage="warmup")):
                    pass
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            # Once the stage has configured the buffer (dropping what an earlier stage left),
            # its data arrives, as rollout would send it.
            deadline = time.monotonic() + 30
            while buffer.status().tau is not None or list(trainer_metrics.FRESHNESS_TAU.collect())[0].samples:
                assert time.monotonic() < deadline, "the stage did not configure the buffer " \
                    "(no bound) and drop the earlier stage's tau series"
                await asyncio.sleep(0.05)
            buffer.put([_traj(i) for i in range(6)], group_size=1)
            while True:
                status = await stub.GetTrainerStatus(trainer_pb2.TrainerStatusRequest())
                if status.stage_done or status.stage_failed or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.05)
            assert status.stage_done and not status.stage_failed, status.message
            assert (status.stage, status.stage_step, status.step) == ("warmup", 3, 3)
            # The final weights of the stage were published and the buffer told the version.
            assert status.policy_version == 1 and publisher.versions == [1]
            assert status.last_step.loss > 0 and status.last_step.tokens == 12
            assert buffer.status().served == 6 and buffer.status().policy_version == 1
            # Retrying RunStage for the stage it ran changes nothing: it is not exported again
            # (the same file stays in place for a frozen deployment fetching it).
            weights = stage_export_dir(tmp_path, "warmup") / "model.safetensors"
            inode = weights.stat().st_ino
            again = await stub.RunStage(trainer_pb2.RunStageRequest(stage="warmup"))
            assert again.stage_step == 3 and again.stage_done
            assert not stages._thread.is_alive() and weights.stat().st_ino == inode
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.RunStage(trainer_pb2.RunStageRequest(stage="nope"))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "nope" in err.value.details()
            # A frozen deployment fetches the stage's final weights, byte for byte.
            client = TrainerClient(f"127.0.0.1:{port}")
            try:
                got = await asyncio.to_thread(client.fetch_stage_export, "warmup", tmp_path / "fetched")
                with pytest.raises(ValueError, match="nope"):
                    await asyncio.to_thread(client.fetch_stage_export, "nope", tmp_path / "x")
            finally:
                client.close()
            export = stage_export_dir(tmp_path, "warmup")
            files = sorted(p.relative_to(export) for p in export.rglob("*") if p.is_file())
            assert got.files == len(files) >= 3 and Path("config.json") in files
            assert all((export / f).read_bytes() == (tmp_path / "fetched" / f).read_bytes() for f in files)
            assert got.bytes == sum((export / f).stat().st_size for f in files)
            assert not (tmp_path / "x").exists()
            # The output folder got the same model before the stage was reported done, and
            # `kiln export` reads it from there.
            output = tmp_path / "out"
            for folder in (output / "stages" / "warmup", output / "final-hf"):
                assert all((export / f).read_bytes() == (folder / f).read_bytes() for f in files)
            summary = json.loads((output / "summary.json").read_text())
            assert summary["stages"]["warmup"] == {"steps": 3, "selected_step": None,
                                                   "policy_version": 1}
            assert summary["final_stage"] == "warmup" and (output / "job.yaml").exists()
            # Beside it the report, drawn from the trainer's own step log: the stage's loss.
            logged = [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
            assert [(r["stage"], r["trainer"]["step"]) for r in logged] == [("warmup", 1), ("warmup", 2),
                                                                           ("warmup", 3)]
            assert all(r["trainer"]["loss"] > 0 for r in logged)
            assert (output / "report" / "loss.png").stat().st_size > 1000
            assert main(["export", str(output), "--out", str(tmp_path / "hf")]) == 0
            assert (tmp_path / "hf" / "model.safetensors").read_bytes() == (
                export / "model.safetensors").read_bytes()
            # And a sample of what it trained on (every rollout.sampleEvery-th: the first of
            # six), which `kiln trajectories` reads from there with the exported tokenizer.
            kept = [json.loads(line) for line in (output / "trajectories.jsonl").read_text().splitlines()]
            assert [(r["stage"], r["id"], r["tokens"]) for r in kept] == [("warmup", "t0", _traj(0).tokens)]
            capsys.readouterr()
            assert main(["trajectories", str(output)]) == 0
            assert "=== t0  stage warmup  task x" in capsys.readouterr().out
            # The trainer's TensorBoard files reached the output at the stage's end; the
            # driver's scalars (the operator's, over RecordScalars) reach it after each
            # held-out evaluation.
            assert _scalars(output / "tensorboard", "train/loss")[-1][0] == 3
            control = TrainerControlClient(f"127.0.0.1:{port}")
            try:
                await asyncio.to_thread(control.record_scalars, 3, {"progress/steps_left": 0.0})
                assert not _tags(output / "tensorboard" / "driver")  # no evaluation yet
                await asyncio.to_thread(control.record_scalars, 3,
                                        {"eval/h/greedy_success": 0.75, "progress/steps_left": 0.0})
            finally:
                control.close()
            assert _scalars(output / "tensorboard" / "driver", "eval/h/greedy_success") == [(3, 0.75)]
            assert [s for s, _ in _scalars(output / "tensorboard" / "driver",
                                           "progress/steps_left")] == [3, 3]
        finally:
            await channel.close()
            await server.stop(0)
        # On shutdown the steps since the last checkpoint are saved, once.
        saved = await servicer.final_checkpoint()
        assert saved is not None and saved.name == "step_00000003"
        assert await servicer.final_checkpoint() is None

    asyncio.run(scenario())
    stages.stop()
    buffer.close()


def _accumulator(folder: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder))
    acc.Reload()
    return acc


def _tags(folder: Path) -> list[str]:
    return _accumulator(folder).Tags()["scalars"] if folder.exists() else []


def _scalars(folder: Path, tag: str) -> list[tuple[int, float]]:
    return [(e.step, e.value) for e in _accumulator(folder).Scalars(tag)]


def test_run_stage_without_a_stage_runner_is_failed_precondition(model_dir: Path, tmp_path: Path) -> None:
    job = _job(model_dir, tmp_path)
    engine = TrainerEngine(config_from_job(job, run_dir=tmp_path))

    async def scenario() -> None:
        server, port = await create_server(
            "127.0.0.1:0", [Registration(add_to_server, TrainerServicer(engine), SERVICE_NAME)])
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = trainer_pb2_grpc.TrainerStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.RunStage(trainer_pb2.RunStageRequest(stage="warmup"))
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            status = await stub.GetTrainerStatus(trainer_pb2.TrainerStatusRequest())
            assert (status.step, status.policy_version, status.stage_max_steps) == (0, 0, 0)
        await server.stop(0)

    asyncio.run(scenario())


def test_an_export_that_arrives_broken_leaves_nothing_behind(tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "config.json").write_text("{}")
    (src / "sub" / "weights.bin").write_bytes(bytes(range(256)) * 50)
    (src / "empty").write_bytes(b"")
    chunks = list(export_chunks(src, chunk_bytes=1000))
    writer = ExportWriter(tmp_path / "ok")
    writer.write(chunks)
    assert (writer.files, writer.bytes) == (3, 2 + 12800)
    assert (tmp_path / "ok" / "sub" / "weights.bin").read_bytes() == (src / "sub" / "weights.bin").read_bytes()
    assert (tmp_path / "ok" / "empty").read_bytes() == b""
    flipped = [trainer_pb2.ExportChunk(path=c.path, data=c.data[::-1], size=c.size, sha256=c.sha256)
               if i == 3 else c for i, c in enumerate(chunks)]
    for broken, what in ((chunks[:-1], "ended inside"), (flipped, "digest"),
                         ([trainer_pb2.ExportChunk(path="../evil", data=b"x", size=1, sha256="0")],
                          "outside the export")):
        with pytest.raises(ExportError, match=what):
            ExportWriter(tmp_path / "bad").write(broken)
        assert not (tmp_path / "bad").exists()
        assert [p.name for p in tmp_path.iterdir()] and not [p for p in tmp_path.iterdir() if "partial" in p.name]
