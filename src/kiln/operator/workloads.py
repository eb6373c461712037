"""Pod templates and workloads (Deployments, the trainer StatefulSet) of an RLJob, as pure functions.

Every service container runs `kiln-<component> --job /etc/kiln/job.yaml --address 0.0.0.0:50051
--metrics-port 9090 --run-dir /var/lib/kiln` from `spec.image`, with the component's
`spec.<component>.resources`, mutual TLS with the component's certificate (Secret
`<job>-<component>-tls` at /etc/kiln/tls), Kubernetes-native gRPC probes against a plain-text,
health-only port 50050, and one `KILN_<COMPONENT>_ADDR` variable per peer; each runs as an
unprivileged uid with no capabilities. The sandbox pod is the exception: with bubblewrap its
container is privileged root, with docker it has a privileged Docker-in-pod sidecar (`docker:dind`,
a native sidecar so it starts first) whose limits cover `maxConcurrent` sandboxes of the spec's
size; the pod gets the operator's sandbox RuntimeClass when one is set (`SandboxHosting`).

Not covered: Services, PVCs and the job ConfigMap (`kiln.operator.children`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kiln.api.base import quantity_value
from kiln.api.ports import RENDEZVOUS_PORT
from kiln.api.openai_endpoint import HOST_ENV, KEYS_DIR, KEYS_ENV
from kiln.api.spec import RLJobSpec
from kiln.operator import naming
from kiln.operator.naming import JobRef
from kiln.operator.pods import (SERVICE_UID, deployment, job_volume, model_init_container,
                                model_volume, pod_template, scratch, service_container)
from kiln.operator.sources import mount_output, mount_task_sources

DIND_IMAGE = "docker:27-dind"


@dataclass(frozen=True)
class SandboxHosting:
    """How the cluster hosts sandbox pods (the operator's settings, not the job's)."""

    dind_image: str = DIND_IMAGE
    """Docker-in-pod sidecar image (docker backend)."""
    runtime_class: str = ""
    """RuntimeClass of sandbox pods (e.g. kata, gvisor): a kernel of their own per pod, so the
    privileges the sandbox needs stay inside it. Empty: the node's default runtime."""
TRAINER_REPLICAS = "trainer-replica"
DIND_SOCKET_DIR = "/run/dind"

def _rendezvousservice_env(job: JobRef, replica: dict[str, str]) -> list[dict[str, Any]]:
    """Where the trainer's ranks meet: trainer pod 0, by its stable name under the trainer's
    headless Service (published before it is ready, as the ranks meet before that)."""
    host = f"{job.child('trainer')}-0.{job.child('trainer')}.{job.namespace}.svc"
    return [{"name": "MASTER_ADDR", "value": host},
            {"name": "MASTER_PORT", "value": str(RENDEZVOUS_PORT)}, replica]


def _trainer_statefulset(job: JobRef, spec: RLJobSpec, component: str, config_hash: str,
                         replicas: int, run_volume: dict[str, Any],
                         rendezvous: list[dict[str, Any]]) -> dict[str, Any]:
    volumes, mounts, env = model_volume(spec)
    container = service_container(job, spec, "trainer", spec.trainer.resources, [*env, *rendezvous], mounts)
    if rendezvous:
        container["ports"].append({"name": "rendezvous", "containerPort": RENDEZVOUS_PORT, "protocol": "TCP"})
    template = pod_template(job, spec, "trainer", config_hash, [container],
                            [job_volume(job), {"name": "run", **run_volume}, *volumes],
                            model_init_container(spec, spec.trainer.resources),
                            grace_seconds=120)  # room to write a checkpoint on SIGTERM
    mount_task_sources(template, spec)
    # Replica pods carry their own component label: the trainer Service (the Trainer RPCs,
    # which replica 0 alone serves) must not select them.
    template["metadata"]["labels"].update(naming.selector_labels(job, component))
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": naming.metadata(job, component, spec.image),
        "spec": {
            "replicas": replicas,
            "serviceName": job.child("trainer"),
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": naming.selector_labels(job, component)},
            "template": template,
        },
    }


def trainer(job: JobRef, spec: RLJobSpec, config_hash: str, active: bool) -> dict[str, Any]:
    """Replica 0 of the trainer: the Trainer service, and the only one with the checkpoints
    volume (a restarted trainer resumes from its last checkpoint)."""
    dp = spec.trainer.data_parallel
    rendezvous = _rendezvousservice_env(job, {"name": "KILN_TRAINER_REPLICA", "value": "0"}) if dp > 1 else []
    sts = _trainer_statefulset(job, spec, "trainer", config_hash, 1 if active else 0,
                               {"persistentVolumeClaim": {"claimName": job.child("checkpoints")}},
                               rendezvous)
    mount_output(sts["spec"]["template"], spec)  # replica 0 writes each stage's model out
    return sts


def trainer_replicas(job: JobRef, spec: RLJobSpec, config_hash: str, active: bool) -> dict[str, Any] | None:
    """Data-parallel replicas 1..dp-1 (pod `-N` is replica N+1). They keep no checkpoints:
    replica 0 hands them its state when the ranks meet."""
    dp = spec.trainer.data_parallel
    if dp == 1:
        return None
    rendezvous = _rendezvousservice_env(job, {"name": "KILN_TRAINER_REPLICA_OFFSET", "value": "1"})
    return _trainer_statefulset(job, spec, TRAINER_REPLICAS, config_hash, dp - 1 if active else 0,
                                scratch(spec.trainer.resources), rendezvous)


def rollout(job: JobRef, spec: RLJobSpec, config_hash: str, active: bool,
            frozen_addresses: list[dict[str, Any]] = ()) -> dict[str, Any]:
    """`frozen_addresses`: where its teachers, subagents and reward models are (`frozen.py`)."""
    volumes, mounts, env = model_volume(spec)
    # Each replica its own task stream (the producer salts the job's seed with it); a pod scaled
    # away first lets its episodes finish (within the grace period below).
    env = [*env, {"name": "KILN_ROLLOUT_REPLICA", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
           {"name": "KILN_ROLLOUT_DRAIN_SECONDS", "value": "50"}, *frozen_addresses]
    container = service_container(job, spec, "rollout", spec.rollout.resources, env, mounts)
    volumes = [job_volume(job), {"name": "run", **scratch(spec.rollout.resources)}, *volumes]
    if spec.rollout.openai_port:
        # The API keys reach this container alone (`OperatorConfig.refusals` wants a Secret).
        container["ports"].append({"name": "openai", "containerPort": spec.rollout.openai_port,
                                   "protocol": "TCP"})
        container["env"] += [{"name": KEYS_ENV, "value": KEYS_DIR}, {"name": HOST_ENV, "value": "0.0.0.0"}]
        container["volumeMounts"].append({"name": "openai-keys", "mountPath": KEYS_DIR, "readOnly": True})
        volumes.append({"name": "openai-keys", "secret": {
            "secretName": spec.rollout.openai.api_key_secret or "", "defaultMode": 0o440}})
    template = pod_template(job, spec, "rollout", config_hash, [container], volumes,
                            model_init_container(spec, spec.rollout.resources), grace_seconds=60)
    mount_task_sources(template, spec)
    return deployment(job, spec, "rollout", spec.rollout.replicas if active else 0, template)


def dind_resources(spec: RLJobSpec) -> dict[str, Any]:
    """Room for one sandbox guaranteed, `maxConcurrent` of the spec's size at most. A
    container's workspace is a tmpfs (its disk quota), so its memory is memory plus disk."""
    sb = spec.sandbox
    memory = quantity_value(sb.memory) + quantity_value(sb.disk)
    storage = sb.resources.ephemeral_storage  # images and container layers
    one = {"cpu": f"{round(sb.cpu * 1000)}m", "memory": f"{int(memory // 2**20)}Mi",
           "ephemeral-storage": storage}
    most = {"cpu": f"{round(sb.cpu * sb.max_concurrent * 1000)}m",
            "memory": f"{int(memory * sb.max_concurrent // 2**20)}Mi",
            "ephemeral-storage": storage}
    return {"requests": one, "limits": most}


def dind_sidecar(spec: RLJobSpec, image: str = DIND_IMAGE) -> dict[str, Any]:
    socket = f"unix://{DIND_SOCKET_DIR}/docker.sock"
    return {
        "name": "dind",
        "image": image,
        # A native sidecar: started (and ready) before the sandbox service, stopped after it.
        "restartPolicy": "Always",
        "args": [f"--host={socket}", f"--group={SERVICE_UID}"],
        "env": [{"name": "DOCKER_TLS_CERTDIR", "value": ""}],
        "securityContext": {"privileged": True},
        "resources": dind_resources(spec),
        "startupProbe": {"exec": {"command": ["docker", "-H", socket, "info"]},
                         "periodSeconds": 2, "failureThreshold": 60},
        "volumeMounts": [
            {"name": "dind-socket", "mountPath": DIND_SOCKET_DIR},
            {"name": "dind-storage", "mountPath": "/var/lib/docker"},
        ],
    }


def sandbox(job: JobRef, spec: RLJobSpec, config_hash: str, active: bool,
            hosting: SandboxHosting = SandboxHosting()) -> dict[str, Any]:
    """The sandbox service's pod. Sandboxes need privileges a pod does not have by default:
    bubblewrap creates cgroups (the limits) and mounts (the disk quota), so its container runs
    as root, privileged; the docker backend's dind sidecar is privileged and the service beside
    it is not. The operator admits either only where its admin allows it or the pod runs in an
    isolating runtime class (`OperatorConfig.refusals`)."""
    docker = spec.sandbox.backend == "docker"
    volumes = [job_volume(job), {"name": "run", **scratch(spec.sandbox.resources)}]
    env: list[dict[str, Any]] = []
    mounts: list[dict[str, Any]] = []
    sidecars: list[dict[str, Any]] = []
    if docker:
        env = [{"name": "DOCKER_HOST", "value": f"unix://{DIND_SOCKET_DIR}/docker.sock"}]
        mounts = [{"name": "dind-socket", "mountPath": DIND_SOCKET_DIR}]
        volumes += [{"name": "dind-socket", "emptyDir": {}},
                    {"name": "dind-storage", **scratch(spec.sandbox.resources)}]
        sidecars = [dind_sidecar(spec, hosting.dind_image)]
    # bubblewrap keeps each sandbox's workspace image in the container's own filesystem.
    images = (0 if docker or spec.sandbox.workspace_fs == "tmpfs"
              else quantity_value(spec.sandbox.disk) * spec.sandbox.max_concurrent)
    container = service_container(job, spec, "sandbox", spec.sandbox.resources, env, mounts,
                                  extra_storage_bytes=int(images))
    if not docker:
        # Root for cgroups, uid changes and mounts; privileged because a container's cgroup
        # tree is read-only otherwise. Each sandbox still drops to an unprivileged uid with no
        # capabilities inside its own namespaces.
        container["securityContext"] = {"privileged": True, "runAsUser": 0, "runAsGroup": 0,
                                        "runAsNonRoot": False}
    template = pod_template(job, spec, "sandbox", config_hash, [container], volumes, sidecars)
    mount_task_sources(template, spec)
    if hosting.runtime_class:
        template["spec"]["runtimeClassName"] = hosting.runtime_class
    return deployment(job, spec, "sandbox", spec.sandbox.replicas if active else 0, template)


def weight_sync(job: JobRef, spec: RLJobSpec, config_hash: str, active: bool) -> dict[str, Any]:
    container = service_container(job, spec, "weight-sync", spec.weight_sync.resources)
    volumes = [job_volume(job), {"name": "run", **scratch(spec.weight_sync.resources)}]
    template = pod_template(job, spec, "weight-sync", config_hash, [container], volumes)
    return deployment(job, spec, "weight-sync", 1 if active else 0, template)


def buffer(job: JobRef, spec: RLJobSpec, config_hash: str, active: bool) -> dict[str, Any]:
    container = service_container(job, spec, "buffer", spec.buffer.resources)
    volumes = [job_volume(job),
               {"name": "run", "persistentVolumeClaim": {"claimName": job.child("buffer")}}]
    template = pod_template(job, spec, "buffer", config_hash, [container], volumes)
    return deployment(job, spec, "buffer", 1 if active else 0, template, recreate=True)


def workloads(job: JobRef, spec: RLJobSpec, hashes: dict[str, str], *, active: bool,
              hosting: SandboxHosting = SandboxHosting(),
              frozen_addresses: list[dict[str, Any]] = ()) -> list[dict[str, Any]]:
    replicas = trainer_replicas(job, spec, hashes["trainer"], active)
    return [
        trainer(job, spec, hashes["trainer"], active),
        *([replicas] if replicas is not None else []),
        rollout(job, spec, hashes["rollout"], active, frozen_addresses),
        sandbox(job, spec, hashes["sandbox"], active, hosting),
        weight_sync(job, spec, hashes["weight-sync"], active),
        buffer(job, spec, hashes["buffer"], active),
    ]
