"""`kiln-trainer`: the trainer service process.

    kiln-trainer --job job.yaml --run-dir runs/x/trainer --address 0.0.0.0:50052 [--stage NAME]
    kiln-trainer --model-dir path/to/hf-checkpoint --run-dir runs/x/trainer   (no job file)

Loads the model (resuming the newest checkpoint under `<run-dir>/checkpoints`), serves
`kiln.v1.Trainer`, and on SIGTERM writes a final checkpoint if it stepped since the last one.
With `spec.trainer.tensorParallel` > 1 it starts the replica's other ranks itself; with
`dataParallel` > 1 one such process runs per replica (see `ranks.py`): replica 0 serves the
Trainer service, the others answer health checks and follow.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Sequence

from kiln.control import channels
from kiln.api.capabilities import job_model_refusals
from kiln.api.outputs import OUTPUT_DIR_ENV
from kiln.api.spec import RLJob
from kiln.services.common.server import Registration, run_service, service_argparser
from kiln.services.trainer import ranks
from kiln.services.trainer.config import TrainerConfig, config_from_job

log = logging.getLogger("kiln.trainer")


def build_parser() -> argparse.ArgumentParser:
    p = service_argparser("trainer")
    p.add_argument("--stage", help="stage whose learning rate and loss settings apply (default: the first)")
    p.add_argument("--model-dir", type=Path, help="HF checkpoint to start from (overrides spec.model.path)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], help="override spec.model.dtype")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--local-rank", type=int, default=0,
                   help="this process's rank inside its replica (started by local rank 0; not for users)")
    return p


def config_from(job: RLJob | None, args: argparse.Namespace) -> TrainerConfig:
    if job is not None:
        cfg = config_from_job(job, run_dir=args.run_dir, stage=args.stage, model_dir=args.model_dir)
    elif args.model_dir is not None:
        cfg = TrainerConfig(model_dir=args.model_dir, checkpoint_dir=args.run_dir / "checkpoints")
    else:
        raise ValueError("give --job or --model-dir")
    if args.dtype:
        cfg = cfg.model_copy(update={"params_dtype": args.dtype})
    if not (cfg.model_dir / "config.json").exists():
        raise ValueError(f"model directory {cfg.model_dir} has no config.json (create the model first)")
    if job is not None:
        refused = job_model_refusals(job.spec, "trainer", model_dir=cfg.model_dir)
        if refused:
            raise ValueError(f"{cfg.model_dir}: {refused[0]}")
    return cfg


def _engine(cfg: TrainerConfig, world: ranks.World | None):
    from kiln.services.trainer.engine import TrainerEngine

    if world is not None:
        ranks.enter(world)
    return TrainerEngine(cfg)


async def build(job: RLJob | None, args: argparse.Namespace, argv: list[str]):
    import torch

    from kiln.services.trainer.servicer import SERVICE_NAME, TrainerServicer, add_to_server

    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = config_from(job, args)
    world = None
    children = []
    if cfg.tensor_parallel * cfg.data_parallel > 1:
        world = ranks.world_from(cfg.tensor_parallel, cfg.data_parallel, 0)
        # The other local ranks must be running for the process group to form.
        children = ranks.spawn_local_ranks(world, argv)
        log.info("trainer rank %d of %d (replica %d); rendezvous %s:%d", world.rank, world.size,
                 world.replica, world.master_addr, world.master_port)
    engine = await asyncio.to_thread(_engine, cfg, world)
    if world is not None and world.rank != 0:
        return await _follower(engine, children, args)
    if world is not None:
        engine = ranks.ReplicatedEngine(engine)
    log.info("trainer ready: step %d, policy version %d, resumed from %s",
             engine.step_count, engine.policy_version, engine.resumed_from)
    engine_lock = threading.Lock()
    stages = await _stage_runner(job, engine, engine_lock, args) if job is not None else None
    servicer = TrainerServicer(engine, engine_lock, stages)

    async def on_stop() -> None:
        if stages is not None:
            # Let the step in progress finish; the checkpoint below then holds it.
            await asyncio.to_thread(stages.stop)
            if stages.tracker is not None:
                stages.tracker.close()
        path = await servicer.final_checkpoint()
        if path is not None:
            log.info("final checkpoint %s", path)
        if world is not None:
            await asyncio.to_thread(engine.close)
            for child in children:
                await asyncio.to_thread(child.wait, args.grace)

    return [Registration(add_to_server, servicer, SERVICE_NAME)], on_stop


async def _follower(engine, children: list, args: argparse.Namespace):
    """Local rank 0 of a replica other than 0: health checks only, and the engine follows
    rank 0. The process ends when rank 0 releases the ranks (or the world breaks)."""
    done = threading.Event()

    def run() -> None:
        try:
            ranks.follow(engine)
        except Exception:
            log.exception("the trainer world broke; exiting so that every rank restarts")
            os._exit(1)
        done.set()
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=run, daemon=True, name="trainer-follower").start()

    async def on_stop() -> None:
        # Replica 0 may still need this replica for its final checkpoint's collectives.
        await asyncio.to_thread(done.wait, args.grace)
        for child in children:
            await asyncio.to_thread(child.wait, args.grace)

    return [], on_stop


def _local_rank_main(args: argparse.Namespace) -> int:
    """Local ranks 1..tp-1: no server; the engine follows rank 0 until released."""
    from kiln.api.validate import load_job
    from kiln.logs import setup_logging

    setup_logging("trainer")
    # SIGTERM goes to the replica's local rank 0, which releases this rank after its final
    # checkpoint; the parent's death kills this process (PR_SET_PDEATHSIG).
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    cfg = config_from(load_job(args.job) if args.job else None, args)
    world = ranks.world_from(cfg.tensor_parallel, cfg.data_parallel, args.local_rank)
    engine = _engine(cfg, world)
    ranks.follow(engine)
    return 0


async def _stage_runner(job: RLJob, engine, engine_lock: threading.Lock, args: argparse.Namespace):
    """The stage runner, when the buffer and weight-sync addresses are known (else None)."""

    from kiln.services.buffer.client import GrpcBufferClient
    from kiln.tracking import Tracker
    from kiln.services.trainer.publisher import GrpcWeightPublisher
    from kiln.services.trainer.stages import StageRunner

    buffer_addr = os.environ.get("KILN_BUFFER_ADDR")
    sync_addr = os.environ.get("KILN_WEIGHT_SYNC_ADDR")
    if not buffer_addr or not sync_addr:
        log.info("no KILN_BUFFER_ADDR/KILN_WEIGHT_SYNC_ADDR: serving RPCs only, no stages")
        return None
    channel = channels.aio_channel(sync_addr, "weight-sync")
    ws = job.spec.weight_sync
    publisher = GrpcWeightPublisher(asyncio.get_running_loop(), channel, bucket_bytes=ws.bucket_bytes,
                                    timeout=ws.timeout_seconds, record=args.run_dir / "weight_sync.json")
    await _agree_with_weight_sync(engine, channel, ws.bucket_bytes)
    tracker = Tracker(args.run_dir / "tensorboard", run_name="trainer", group=job.metadata.name,
                      spec=job.spec.tracking, config=job.spec.model_dump(mode="json", by_alias=True))
    # Where the operator mounted the job's output volume (spec.output), if it has one.
    output = os.environ.get(OUTPUT_DIR_ENV)
    return StageRunner(job, engine, engine_lock, GrpcBufferClient(buffer_addr), publisher,
                       args.run_dir, tracker, output or None)


async def _agree_with_weight_sync(engine, channel, bucket_bytes: int) -> None:
    """Make weight-sync's latest version the weights this trainer holds, before any stage.

    Versions are published every sync interval and checkpointed less often, so a trainer that
    crashed resumes at version V while weight-sync may hold V+k: weights nobody has any more,
    and every publish of V+1.. would be refused as stale. The trainer then takes the next
    version after weight-sync's, with the weights it has. A weight-sync that restarted (it keeps
    versions in memory) gets the trainer's version again. Weights resumed from a checkpoint
    taken between publishes are not their version's (rollout serves that version's weights):
    they are published as the next version too.
    """
    from kiln.services.weight_sync.client import PublishError, publish, status

    latest = int((await status(channel)).policy_version)
    if latest > engine.policy_version:
        log.warning("weight-sync holds version %d, this trainer resumed at %d (versions since its "
                    "last checkpoint were lost with it): publishing its weights as version %d",
                    latest, engine.policy_version, latest + 1)
        engine.policy_version = latest
        version = engine.new_version()
    elif engine.unpublished:
        log.info("resumed at step %d with weights newer than version %d's (step %d): publishing "
                 "them as version %d", engine.step_count, engine.policy_version,
                 engine.published_step, engine.policy_version + 1)
        version = engine.new_version()
    elif engine.policy_version > latest:
        version = engine.policy_version
    else:
        return  # both hold the same version
    try:
        await publish(channel, version, list(engine.named_hf_tensors()), bucket_bytes)
    except PublishError as exc:
        if exc.retryable:
            raise
        log.info("weight-sync already holds version %d or newer", version)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = parser.parse_args(argv)
        if args.local_rank:
            return _local_rank_main(args)
        return run_service("trainer", lambda job, a: build(job, a, argv), argv, parser=parser)
    except ValueError as exc:
        # Configuration errors do not go away on restart.
        print(f"kiln-trainer: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
