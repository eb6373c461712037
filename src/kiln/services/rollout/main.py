"""`kiln-rollout`: the rollout service process.

    kiln-rollout --job job.yaml --run-dir runs/x/rollout --address 0.0.0.0:50051

Starts the vLLM engine on the job's model, subscribes to weight-sync for new policy versions
(applied in place, with exact per-token versions), and serves `kiln.v1.Rollout`, which a stage
driver uses to set the mode and run evaluations. Addresses of the services it talks to come from
`KILN_SANDBOX_ADDR` (environment episodes), `KILN_BUFFER_ADDR` and `KILN_WEIGHT_SYNC_ADDR`, as the
operator sets them in the pod. With `spec.rollout.openaiPort` set it also serves the OpenAI
chat-completions API there (`openai_server.py`), whose rewarded episodes go to the buffer: to
callers with a key from `KILN_OPENAI_API_KEYS` (a file or folder: `openai_auth.py`), on
`KILN_OPENAI_HOST` (default 127.0.0.1; the operator sets 0.0.0.0 in a pod).
Every tenth finished trajectory is also kept in `<run-dir>/trajectories.jsonl` for
`kiln trajectories`.

    kiln-rollout --job job.yaml --teacher DIR ...

serves a frozen deployment instead: the checkpoint in DIR, never updated, answering `Score`
(a teacher's) and `Generate` (a swarm's subagents'); with `--teacher-stage STAGE` it first
fetches that stage's final weights from the trainer into DIR (the operator's frozen
deployments: `kiln.operator.frozen`). A job
with on-policy distillation stages (`rl.advantage: opd`) has its rollout send each group of
trajectories of those stages to the teacher of their task set and ship them with the
teacher's per-token log-probs; the job's teachers, in `kiln.api.distillation.teacher_refs`
order, are at `KILN_TEACHER_ADDR`, `KILN_TEACHER_1_ADDR`, ...; a swarm stage's subagents
(`spec.stages[].swarm.subagents`) are one of those deployments, which its orchestrators'
subagent episodes generate on (`swarm.py`), and so are a task set's reward models
(`rewardRules.outcomeModel` scores, `rewardRules.judge` generates: `reward_models.py`).
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import socket
import sys
from pathlib import Path
from typing import Sequence

from kiln.control import channels
from kiln.files import write_json_whole
from kiln.api.capabilities import job_model_refusals
from kiln.api.distillation import stage_teachers, teacher_process, teacher_refs
from kiln.api.spec import RLJob
from kiln.services.common import metrics
from kiln.services.common.server import Registration, run_service, service_argparser

log = logging.getLogger("kiln.rollout")


def _addr(name: str) -> str:
    value = os.environ.get(f"KILN_{name}_ADDR")
    if not value:
        raise ValueError(f"KILN_{name}_ADDR is not set: the rollout service needs the {name.lower()} "
                         "service's address")
    return value


def opd_stages(job: RLJob) -> frozenset[str]:
    """Names of the job's stages whose trajectories a frozen model scores: on-policy
    distillation (the teacher's log-probs) and KL-penalised stages (the reference's)."""
    return frozenset(s.name for s in job.spec.stages if stage_teachers(s))


def teachers_by_task(job: RLJob, scorers: list) -> dict[tuple[str, str], object]:
    """(opd stage, task set) -> the Scorer of its teacher, `scorers` in `teacher_refs` order."""
    refs = teacher_refs(job.spec)
    return {(stage.name, task): scorers[refs.index(ref)]
            for stage in job.spec.stages for ref, tasks in stage_teachers(stage) for task in tasks}


def swarm_runs(job: RLJob, fmt, sampling) -> dict[str, object]:
    """Stage -> `SwarmRun` (an episode extension) of the job's swarm stages, each one's
    subagents on the frozen deployment of its checkpoint (`kiln.api.distillation.teacher_refs`
    numbers them), sampling at the stage's `subagentTemperature` where it sets one, without tool
    choices."""
    from kiln.services.rollout.agent import Limits
    from kiln.services.rollout.client import FrozenEngine
    from kiln.services.rollout.swarm import Subagents
    from kiln.services.rollout.swarm_run import SwarmRun

    refs, spec, out = teacher_refs(job.spec), job.spec, {}
    s = spec.rollout.sampling
    for stage in spec.stages:
        swarm = getattr(stage, "swarm", None)
        if swarm is None:
            continue
        engine = FrozenEngine(_addr(teacher_process(refs.index(swarm.subagents)).upper()))
        limits = Limits(swarm.max_subagent_turns, s.max_tokens_per_turn, s.max_total_tokens,
                        thinking=spec.rollout.thinking)
        evaluated = stage.eval.tasks if stage.eval else []
        # The frozen subagents choose their tools as their checkpoint does: tool choices
        # (`toolChoiceTemperature`) explore for the policy being trained.
        own = dataclasses.replace(sampling, tool_choice_temperature=None)
        if swarm.subagent_temperature is not None:
            own = dataclasses.replace(own, temperature=swarm.subagent_temperature)
        out[stage.name] = SwarmRun(swarm, Subagents(engine, fmt, own, limits,
                                                    max_per_episode=swarm.max_subagents),
                                   stage.max_steps, frozenset(stage.tasks + evaluated))
    return out


def reward_models(job: RLJob, fmt, scorers: list) -> dict[str, object]:
    """Task set -> `RewardModels` of the task sets whose `rewardRules` name an outcome model or
    a judge: the outcome model scores through its deployment's Score (`scorers`, in
    `teacher_refs` order), the judge generates through its deployment's Generate."""
    from kiln.services.rollout.client import FrozenEngine
    from kiln.services.rollout.reward_models import RewardModels

    refs, out = teacher_refs(job.spec), {}
    for ts in job.spec.tasks:
        rules = ts.reward_rules
        if rules is None or not rules.models():
            continue
        orm, judge = rules.outcome_model, rules.judge
        out[ts.name] = RewardModels(
            fmt, orm, scorers[refs.index(orm.model)] if orm else None, judge,
            FrozenEngine(_addr(teacher_process(refs.index(judge.model)).upper())) if judge else None)
    return out


async def build_teacher(job: RLJob, args: argparse.Namespace):
    """A teacher: the checkpoint in `--teacher`, scoring only (no producer, no weight sync)."""
    from kiln.protos.kiln.v1 import rollout_pb2_grpc
    from kiln.services.rollout.engine import EngineSettings, engine_kind, start_engine
    from kiln.services.rollout.servicer import TeacherServicer

    model_dir = str(args.teacher)
    if args.teacher_stage and not (Path(model_dir) / "config.json").exists():
        # On a cluster the trainer's volume is its own: the stage's weights come over gRPC.
        await asyncio.to_thread(fetch_stage_weights, args.teacher_stage, Path(model_dir))
    if args.teacher_wait:
        # An earlier stage of the job makes this checkpoint: wait for it (health says
        # NOT_SERVING meanwhile).
        log.info("teacher: waiting for %s", model_dir)
        while not (Path(model_dir) / "config.json").exists():
            await asyncio.sleep(1.0)
    if not (Path(model_dir) / "config.json").exists():
        raise ValueError(f"--teacher {model_dir}: no config.json there (a Hugging Face checkpoint "
                         "directory is expected)")
    engine = await start_engine(engine_kind(job.spec.rollout.engine, model_dir),
                                EngineSettings.from_job(job, model_dir=model_dir, tempered_logprobs=False))
    log.info("teacher %s serving scores", model_dir)

    async def on_stop() -> None:
        await engine.close()

    return [Registration(rollout_pb2_grpc.add_RolloutServicer_to_server, TeacherServicer(engine),
                         "kiln.v1.Rollout")], on_stop


def fetch_stage_weights(stage: str, dest: Path) -> None:
    """Stage `stage`'s final weights from the trainer (`KILN_TRAINER_ADDR`) into `dest`."""
    import time

    from kiln.services.trainer.client import TrainerClient

    started = time.monotonic()
    client = TrainerClient(_addr("TRAINER"))
    try:
        got = client.fetch_stage_export(stage, dest)
    finally:
        client.close()
    log.info("teacher: stage %s's weights fetched into %s (%d files, %.1f MB, %.1f s)", stage,
             dest, got.files, got.bytes / 1e6, time.monotonic() - started)


async def build(job: RLJob | None, args: argparse.Namespace):
    from transformers import AutoTokenizer

    from kiln.protos.kiln.v1 import rollout_pb2_grpc
    from kiln.services.buffer.client import GrpcBufferClient
    from kiln.services.rollout.agent import Limits
    from kiln.services.rollout.engine import (EngineBroken, EngineSettings, SamplingOptions, engine_kind,
                                              start_engine)
    from kiln.services.rollout.formats import choose_format, make_format
    from kiln.services.rollout.client import TeacherScorer
    from kiln.services.rollout.producer import Producer, ProducerConfig
    from kiln.services.rollout.servicer import RolloutServicer
    from kiln.services.sandbox.client import GrpcEnvClient
    from kiln.services.weight_sync.client import subscribe_and_apply

    if job is None:
        raise ValueError("--job is required")
    if args.teacher is not None:
        return await build_teacher(job, args)
    spec = job.spec
    refused = job_model_refusals(spec, "rollout")
    if refused:
        raise ValueError(f"{spec.model.path}: {refused[0]}")
    sandbox, buffer_addr, sync_addr = _addr("SANDBOX"), _addr("BUFFER"), _addr("WEIGHT_SYNC")
    tokenizer = AutoTokenizer.from_pretrained(spec.model.tokenizer_path())
    model_type = json.loads((spec.model.local_path() / "config.json").read_text()).get("model_type", "")
    fmt = make_format(choose_format(spec.rollout.tool_call_format, tokenizer, model_type),
                      tokenizer, thinking=spec.rollout.thinking,
                      think_every=spec.rollout.think_every)
    # vLLM has no CPU path for DSA checkpoints; the trainer's own model code generates instead.
    engine = await start_engine(engine_kind(spec.rollout.engine, spec.model.local_path()),
                                EngineSettings.from_job(job))
    env_channel = channels.aio_channel(sandbox, "sandbox")
    env = GrpcEnvClient(env_channel, owner=socket.gethostname())
    task_sets = await env.task_sets()
    s = spec.rollout.sampling
    buffer = GrpcBufferClient(buffer_addr)
    distilled = opd_stages(job)
    clients = [TeacherScorer(_addr(teacher_process(i).upper())) for i in range(len(teacher_refs(spec)))]
    teachers = teachers_by_task(job, clients)
    sampling = SamplingOptions(temperature=s.temperature, top_p=s.top_p,
                               max_tokens=s.max_tokens_per_turn, seed=None,
                               tool_choice_temperature=s.tool_choice_temperature)
    # Stage -> its episode extension (`extensions.py`): the swarm stages' (subagents sampling at
    # swarm.subagentTemperature if set).
    extensions = swarm_runs(job, fmt, sampling)
    judged = reward_models(job, fmt, clients)
    config = ProducerConfig(
        sampling=sampling,
        limits=Limits(spec.rollout.max_turns, s.max_tokens_per_turn, s.max_total_tokens,
                      thinking=spec.rollout.thinking),
        max_concurrent=spec.rollout.max_concurrent_episodes,
        target_occupancy=spec.rollout.target_engine_occupancy,
        samples_path=args.run_dir / "trajectories.jsonl", sample_every=spec.rollout.sample_every,
        opd_stages=distilled,
        teacher_top_k={st.name: st.rl.teacher_top_k for st in spec.stages
                       if getattr(st, "rl", None) is not None and st.rl.teacher_top_k},
        # Set per replica (kiln run's worker index, the pod's name on a cluster).
        stream=os.environ.get("KILN_ROLLOUT_REPLICA", ""))
    producer = Producer(config, engine, env, fmt, buffer, teachers=teachers, reward_models=judged,
                        extensions=extensions)
    producer.start()
    sync_channel = channels.aio_channel(sync_addr, "weight-sync")

    async def apply(version, named_tensors):
        try:
            await engine.apply_weights(version, named_tensors)
        except EngineBroken as exc:
            # A restart loads the model afresh and then takes the latest version whole.
            log.critical("%s; exiting so that this service is restarted", exc)
            os._exit(1)
        metrics.POLICY_VERSION.labels("rollout").set(version)
        log.info("applied policy version %d", version)

    subscription = asyncio.ensure_future(
        subscribe_and_apply(sync_channel, f"rollout-{socket.gethostname()}-{os.getpid()}", apply))
    metrics.POLICY_VERSION.labels("rollout").set(engine.policy_version)
    servicer = RolloutServicer(producer, task_sets)
    openai = None
    if spec.rollout.openai_port:
        from kiln.api.openai_endpoint import ANNOUNCE_ENV, HOST_ENV, PORT_ENV
        from kiln.services.rollout.openai_auth import ApiKeys
        from kiln.services.rollout.openai_episodes import ExternalEpisodes
        from kiln.services.rollout.openai_server import OpenAIServer, replica_name

        async def to_buffer(trajs, group_size: int) -> None:
            await buffer.put_async(trajs, group_size)

        # Rewarded groups must have the size of the stage being trained (else 400).
        openai = OpenAIServer(
            ExternalEpisodes(engine, fmt, to_buffer, max_tokens_per_turn=s.max_tokens_per_turn,
                             max_total_tokens=s.max_total_tokens, settings=spec.rollout.openai,
                             stage_group_size=lambda: producer.mode.group_size),
            model_name=Path(spec.model.path).name, tokenizer=tokenizer, keys=ApiKeys.from_env(),
            host=os.environ.get(HOST_ENV, "127.0.0.1"),
            port=int(os.environ.get(PORT_ENV, spec.rollout.openai_port)),
            on_dead=lambda reason: (log.critical("%s; exiting so that this service is restarted",
                                                 reason), os._exit(1)),
            replica=replica_name(os.environ.get("KILN_ROLLOUT_REPLICA", "")))
        await openai.start()
        if announce := os.environ.get(ANNOUNCE_ENV):
            # For the fleet's router under `kiln run` (on a cluster it finds the pods by DNS).
            write_json_whole(Path(announce), {"url": f"http://{openai.host}:{openai.port}",
                                              "instance": openai.instance})

    async def on_stop() -> None:
        if openai is not None:
            openai.drain()  # the router sends new outside episodes to the other replicas
        # A pod scaled away (the operator sets this within its grace period): episodes in
        # flight finish and ship before the weights stop coming.
        await producer.drain(float(os.environ.get("KILN_ROLLOUT_DRAIN_SECONDS", "0")))
        if openai is not None:
            await openai.stop()
            if announce := os.environ.get(ANNOUNCE_ENV):
                Path(announce).unlink(missing_ok=True)
        subscription.cancel()
        await producer.stop()
        await engine.close()
        await env_channel.close()
        await sync_channel.close()
        for client in clients:
            await client.close()
        for extension in extensions.values():
            await extension.close()
        for models in judged.values():
            if models.judge_engine is not None:
                await models.judge_engine.close()
        await buffer.aclose()

    return [Registration(rollout_pb2_grpc.add_RolloutServicer_to_server, servicer, "kiln.v1.Rollout")], on_stop


def _parser() -> argparse.ArgumentParser:
    p = service_argparser("rollout")
    p.add_argument("--teacher", type=Path, default=None,
                   help="serve this checkpoint as a teacher (Score only, never updated)")
    p.add_argument("--teacher-wait", action="store_true",
                   help="wait for the teacher's checkpoint to appear (an earlier stage makes it)")
    p.add_argument("--teacher-stage", default=None, metavar="STAGE",
                   help="fetch the teacher's checkpoint, the final weights of this stage of the "
                        "job, from the trainer into --teacher DIR (where it cannot be read from "
                        "the trainer's volume: a cluster)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    try:
        return run_service("rollout", build, argv, parser=_parser())
    except ValueError as exc:
        print(f"kiln-rollout: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
