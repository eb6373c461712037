"""The job's frozen deployments on a cluster: one per distinct frozen checkpoint it names.

On-policy distillation teachers (`rl.teacher`, `rl.teachers`), a KL penalty's reference
(`rl.reference`), a swarm stage's subagents (`swarm.subagents`) and a task set's reward models
(`rewardRules.outcomeModel`, `rewardRules.judge`) are each served by a rollout deployment of
their own that weight sync never updates, as `kiln run` serves them with one process each. The
job's distinct checkpoints, in `kiln.api.distillation.teacher_refs` order, become components
`teacher`, `teacher-1`, ...: each a Deployment of one pod running
`kiln-rollout --teacher DIR` (the rollout's image, resources and pod settings; its certificate's
identity is `teacher`, which may call only Trainer.FetchStageExport: a frozen model cannot Put
trajectories or Exec in sandboxes), a Service, and a NetworkPolicy that lets the job's rollout
pods and the operator reach its gRPC port (`CLIENTS`). The rollout finds them at `KILN_TEACHER_ADDR`,
`KILN_TEACHER_1_ADDR`, ... (`addresses`).

Where the checkpoint comes from:
- an earlier stage's name: the trainer's volume is the trainer's alone (ReadWriteOnce), so the
  pod fetches the stage's final weights from the trainer over gRPC (`--teacher-stage`,
  Trainer.FetchStageExport) into its scratch folder, which `spec.rollout.resources
  .ephemeralStorage` must have room for. Its Deployment stays at zero replicas until the stage
  is in `status.finishedStages`: a pod waiting for hours would hold an accelerator, and fail its
  startup probe;
- a checkpoint directory: read where it is, like `spec.model.path` (on the model volume,
  `spec.model.pvc`, for a real cluster).

Not covered: more than one replica per frozen deployment (each scores or generates for the
whole job); a teacher pod restarted after its stage fetches the weights again.
"""
from __future__ import annotations

from typing import Any

from kiln.api.distillation import teacher_refs
from kiln.api.spec import RLJobSpec
from kiln.operator import naming
from kiln.operator import pods
from kiln.operator.naming import GRPC_PORT, METRICS_PORT, JobRef, RUN_DIR
from kiln.operator.pods import job_volume, model_volume, pod_template, scratch, service_container
from kiln.operator.tls import tls_secret_name

# Who may call a frozen deployment's gRPC port (Score, Generate; as the services' CALLERS).
CLIENTS = ("operator", "rollout")
TEACHER_DIR = f"{RUN_DIR}/teacher"
"""Where a teacher pod keeps the stage weights it fetched (its scratch folder)."""


def component(index: int) -> str:
    """The component name of the job's `index`-th frozen deployment (`addr_env_name` turns it
    into the variable `kiln.api.distillation.teacher_process` names)."""
    return "teacher" if index == 0 else f"teacher-{index}"


def frozen(spec: RLJobSpec) -> list[tuple[str, str, str | None]]:
    """(component, checkpoint reference, stage that makes it or None) of each frozen deployment."""
    return [(component(i), ref, ref if spec.is_stage(ref) else None)
            for i, ref in enumerate(teacher_refs(spec))]


def components(spec: RLJobSpec) -> list[str]:
    return [name for name, _, _ in frozen(spec)]


def addresses(job: JobRef, spec: RLJobSpec) -> list[dict[str, Any]]:
    """The rollout's environment variables that point at the frozen deployments."""
    return [{"name": naming.addr_env_name(c), "value": naming.component_address(job, c)}
            for c in components(spec)]


def deployment(job: JobRef, spec: RLJobSpec, name: str, ref: str, stage: str | None,
               config_hash: str, replicas: int) -> dict[str, Any]:
    volumes, mounts, env = model_volume(spec)
    container = service_container(job, spec, "rollout", spec.rollout.resources, env, mounts)
    container["name"] = name
    container["args"] += (["--teacher", TEACHER_DIR, "--teacher-stage", stage] if stage
                          else ["--teacher", ref])
    # Its own name in logs and metrics.
    container["env"] = [{"name": "KILN_COMPONENT", "value": name} if e["name"] == "KILN_COMPONENT"
                        else e for e in container["env"]]
    template = pod_template(job, spec, "rollout", config_hash, [container],
                            [job_volume(job), {"name": "run", **scratch(spec.rollout.resources)},
                             *volumes])
    template["metadata"]["labels"].update(naming.selector_labels(job, name))
    # Its own identity, not the rollout's (`kiln.services.common.tls.CALLERS`).
    for volume in template["spec"]["volumes"]:
        if volume["name"] == "tls":
            volume["secret"]["secretName"] = tls_secret_name(job, "teacher")
    body = pods.deployment(job, spec, name, replicas, template)
    body["metadata"] = naming.metadata(job, name, spec.image)
    return body


def service(job: JobRef, spec: RLJobSpec, name: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": naming.metadata(job, name, spec.image),
        "spec": {
            "selector": naming.selector_labels(job, name),
            "ports": [
                {"name": "grpc", "port": GRPC_PORT, "targetPort": "grpc", "protocol": "TCP",
                 "appProtocol": "grpc"},
                {"name": "metrics", "port": METRICS_PORT, "targetPort": "metrics",
                 "protocol": "TCP"},
            ],
        },
    }


def fetching(spec: RLJobSpec) -> list[str]:
    """The frozen deployments that fetch a stage's weights from the trainer."""
    return [name for name, _, stage in frozen(spec) if stage]


def children(job: JobRef, spec: RLJobSpec, config_hash: str, *, active: bool,
             finished_stages: list[str] = ()) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(Services, Deployments) of the frozen deployments (their NetworkPolicies are made with
    the others', `kiln.operator.children.network_policy`, from `CLIENTS`)."""
    services, deployments = [], []
    for name, ref, stage in frozen(spec):
        up = active and (stage is None or stage in finished_stages)
        services.append(service(job, spec, name))
        deployments.append(deployment(job, spec, name, ref, stage, config_hash, 1 if up else 0))
    return services, deployments


def stale(job: JobRef, previous: RLJobSpec, spec: RLJobSpec) -> list[dict[str, Any]]:
    """References to the children of frozen deployments an edited spec no longer has."""
    gone = components(previous)[len(components(spec)):]
    return [{"apiVersion": api, "kind": kind,
             "metadata": {"name": job.child(name), "namespace": job.namespace}}
            for name in gone
            for api, kind in (("apps/v1", "Deployment"), ("v1", "Service"),
                              ("networking.k8s.io/v1", "NetworkPolicy"))]
