"""Protobuf form of the control plane's records (`kiln.control.records`): the one set of
converters that the rollout, trainer and buffer servicers, the control clients and so both stage
drivers (`kiln run`'s and the operator's) use."""
from __future__ import annotations

import dataclasses

from kiln.control.records import (BufferStatus, Evaluation, ModeRequest, RolloutMode, RolloutStatus,
                                  TrainerStatus)
from kiln.evaluation import TaskCount
from kiln.metrics import StepMetrics
from kiln.protos.kiln.v1 import buffer_pb2 as bpb
from kiln.protos.kiln.v1 import rollout_pb2 as rpb
from kiln.protos.kiln.v1 import trainer_pb2 as tpb


def mode_to_proto(m: ModeRequest) -> rpb.SetModeRequest:
    return rpb.SetModeRequest(mode=int(m.mode), stage=m.stage, task_sets=m.task_sets,
                             group_size=m.group_size, synchronous=m.synchronous,
                             batch_size=m.batch_size, seed=m.seed, tau=m.tau,
                             min_version=m.min_version)


def mode_from_proto(msg: rpb.SetModeRequest) -> ModeRequest:
    return ModeRequest(RolloutMode(msg.mode), msg.stage, list(msg.task_sets), msg.group_size,
                       msg.synchronous, msg.batch_size, msg.seed,
                       msg.tau if msg.HasField("tau") else None, msg.min_version)


def rollout_status_to_proto(s: RolloutStatus) -> rpb.RolloutStatus:
    return rpb.RolloutStatus(
        mode=int(s.mode), stage=s.stage, policy_version=s.policy_version, episodes=s.episodes,
        tokens_generated=s.tokens_generated, tokens_per_second=s.tokens_per_second,
        mean_reward=s.mean_reward, in_flight=s.in_flight,
        engine_fingerprint=s.engine_fingerprint, shipped=s.shipped,
        stopped_stale=s.stopped_stale, generating=s.generating,
        teacher_seconds=s.teacher_seconds, teacher_tokens=s.teacher_tokens,
        eval_tasks_done=s.eval_tasks_done, eval_tasks=s.eval_tasks)


def rollout_status_from_proto(msg: rpb.RolloutStatus) -> RolloutStatus:
    return RolloutStatus(
        RolloutMode(msg.mode), msg.stage, msg.policy_version, msg.episodes,
        msg.tokens_generated, msg.tokens_per_second, msg.mean_reward, msg.in_flight,
        msg.engine_fingerprint, msg.shipped, msg.stopped_stale, msg.generating,
        msg.teacher_seconds, msg.teacher_tokens, msg.eval_tasks_done, msg.eval_tasks)


def evaluation_to_proto(e: Evaluation) -> rpb.EvaluateResponse:
    return rpb.EvaluateResponse(policy_version=e.policy_version, tasks=e.tasks,
                               greedy_success=e.greedy_success,
                               sampled_success=e.sampled_success, seconds=e.seconds,
                               critical_path_steps=e.critical_path_steps,
                               critical_path_steps_answered=e.critical_path_steps_answered,
                               task_counts=[rpb.TaskCount(task_id=t.id, samples=t.samples,
                                                          successes=t.successes, greedy=t.greedy)
                                            for t in e.task_counts])


def evaluation_from_proto(msg: rpb.EvaluateResponse) -> Evaluation:
    counts = [TaskCount(t.task_id, t.samples, t.successes,
                        t.greedy if t.HasField("greedy") else None) for t in msg.task_counts]
    return Evaluation(msg.policy_version, msg.tasks, msg.greedy_success, msg.sampled_success,
                      msg.seconds, msg.critical_path_steps, msg.critical_path_steps_answered,
                      counts)


def step_metrics_to_proto(m: StepMetrics) -> tpb.StepMetrics:
    values = {k: v for k, v in dataclasses.asdict(m).items() if v is not None and k != "staleness"}
    return tpb.StepMetrics(**values, staleness=m.staleness)


def step_metrics_from_proto(msg: tpb.StepMetrics) -> StepMetrics:
    # The same names on both sides (tests/unit/test_metric_names.py); unset optional fields are
    # the metrics a step did not measure.
    values = {f.name: getattr(msg, f.name) for f in dataclasses.fields(StepMetrics)
              if f.name != "staleness" and (not msg.DESCRIPTOR.fields_by_name[f.name].has_presence
                                            or msg.HasField(f.name))}
    return StepMetrics(**values, staleness=dict(msg.staleness))


def trainer_status_to_proto(s: TrainerStatus) -> tpb.TrainerStatus:
    return tpb.TrainerStatus(
        step=s.step, policy_version=s.policy_version, stage=s.stage,
        last_step=step_metrics_to_proto(s.last_step) if s.last_step is not None else None,
        last_checkpoint=s.last_checkpoint, tensor_parallel=s.tensor_parallel,
        model_dir=s.model_dir, stage_step=s.stage_step, stage_max_steps=s.stage_max_steps,
        stage_done=s.stage_done, stage_failed=s.stage_failed, message=s.message,
        stage_eval_step=s.stage_eval_step, stage_selected_step=s.stage_selected_step,
        stage_selected_reason=s.stage_selected_reason)


def trainer_status_from_proto(msg: tpb.TrainerStatus) -> TrainerStatus:
    return TrainerStatus(
        step=msg.step, policy_version=msg.policy_version, stage=msg.stage,
        last_step=step_metrics_from_proto(msg.last_step) if msg.HasField("last_step") else None,
        last_checkpoint=msg.last_checkpoint,
        tensor_parallel=msg.tensor_parallel, model_dir=msg.model_dir, stage_step=msg.stage_step,
        stage_max_steps=msg.stage_max_steps, stage_done=msg.stage_done,
        stage_failed=msg.stage_failed, message=msg.message, stage_eval_step=msg.stage_eval_step,
        stage_selected_step=(msg.stage_selected_step if msg.HasField("stage_selected_step")
                             else None),
        stage_selected_reason=msg.stage_selected_reason)


_BUFFER_STATUS_FIELDS = ("depth", "ready", "groups_pending", "groups_ready", "accepted", "served",
                         "dropped_stale", "dropped_other", "batches", "max_staleness",
                         "policy_version", "capacity", "group_size", "leased", "leases",
                         "batches_acked", "redeliveries", "lease_timeout", "unconsumed_bytes",
                         "capacity_bytes")


def buffer_status_to_proto(s: BufferStatus) -> bpb.BufferStatus:
    msg = bpb.BufferStatus(**{f: getattr(s, f) for f in _BUFFER_STATUS_FIELDS})
    if s.tau is not None:
        msg.tau = s.tau
    return msg


def buffer_status_from_proto(msg: bpb.BufferStatus) -> BufferStatus:
    return BufferStatus(tau=msg.tau if msg.HasField("tau") else None,
                        **{f: getattr(msg, f) for f in _BUFFER_STATUS_FIELDS})
