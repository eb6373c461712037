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
from kiln.api.scheduling import PodSettings
from kiln.api.spec import Resources, RLJobSpec
from kiln.operator import naming
from kiln.operator.tls import tls_secret_name
from kiln.operator.naming import (CONFIG_HASH, GRPC_PORT, JOB_FILE, METRICS_PORT, MODEL_ROOT,
                                  RUN_DIR, JobRef)

DIND_IMAGE = "docker:27-dind"


@dataclass(frozen=True)
class SandboxHosting:
    """How the cluster hosts sandbox pods (the operator's settings, not the job's)."""

    dind_image: str = DIND_IMAGE
    """Docker-in-pod sidecar image (docker backend)."""
    runtime_class: str = ""
    """RuntimeClass of sandbox pods (e.g. kata, gvisor): a kernel of their own per pod, so the
    privileges the sandbox needs stay inside it. Empty: the node's default runtime."""
RENDEZVOUS_PORT = 29500  # torch.distributed's customary port
HEALTH_PORT = 50050
TLS_DIR = "/etc/kiln/tls"
TRAINER_REPLICAS = "trainer-replica"
DIND_SOCKET_DIR = "/run/dind"
SERVICE_UID = 1000

def resources(res: Resources, extra_storage_bytes: int = 0) -> dict[str, Any]:
    """Requests equal limits (Guaranteed QoS): training and engines should not be throttled or
    evicted ahead of best-effort pods. Local disk is bounded too (`ephemeral-storage`: the
    container's own layer, its logs and the pod's emptyDir folders), plus `extra_storage_bytes`
    for what the component keeps there by design (the sandboxes' workspace images)."""
    storage = res.ephemeral_storage
    if extra_storage_bytes:
        storage = f"{int(quantity_value(storage) + extra_storage_bytes) // 2**20}Mi"
    amounts: dict[str, Any] = {"cpu": res.cpu, "memory": res.memory, "ephemeral-storage": storage}
    limits = dict(amounts)
    if res.gpu:
        limits["nvidia.com/gpu"] = res.gpu
    return {"requests": amounts, "limits": limits}


def _grpc_probes() -> dict[str, Any]:
    # The kubelet's gRPC probes speak plain text: they go to the health-only port.
    probe = {"grpc": {"port": HEALTH_PORT}}
    return {
        # Loading a model or replaying a buffer can take minutes; liveness starts after that.
        "startupProbe": {**probe, "periodSeconds": 10, "failureThreshold": 90, "timeoutSeconds": 5},
        "readinessProbe": {**probe, "periodSeconds": 5, "failureThreshold": 2, "timeoutSeconds": 5},
        "livenessProbe": {**probe, "periodSeconds": 20, "failureThreshold": 3, "timeoutSeconds": 5},
    }


def _env(job: JobRef, component: str) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [
        {"name": "KILN_JOB_NAME", "value": job.name},
        {"name": "KILN_COMPONENT", "value": component},
        {"name": "KILN_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        {"name": "KILN_POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
    ]
    env += [{"name": naming.addr_env_name(c), "value": naming.component_address(job, c)}
            for c in naming.COMPONENTS]
    return env


def _service_security() -> dict[str, Any]:
    return {
        "runAsNonRoot": True,
        "runAsUser": SERVICE_UID,
        "runAsGroup": SERVICE_UID,
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def pod_settings(spec: RLJobSpec, component: str) -> PodSettings:
    return getattr(spec, component.replace("-", "_")).pod


def service_container(job: JobRef, spec: RLJobSpec, component: str, res: Resources,
                      extra_env: list[dict[str, Any]] = (), extra_mounts: list[dict[str, Any]] = (),
                      extra_storage_bytes: int = 0) -> dict[str, Any]:
    settings = pod_settings(spec, component)
    container = {
        "name": component,
        "image": spec.image,
        "imagePullPolicy": "IfNotPresent",
        "command": [f"kiln-{component}"],
        "args": ["--job", JOB_FILE, "--address", f"0.0.0.0:{GRPC_PORT}",
                 "--metrics-port", str(METRICS_PORT), "--run-dir", RUN_DIR,
                 "--health-address", f"0.0.0.0:{HEALTH_PORT}"],
        "ports": [
            {"name": "grpc", "containerPort": GRPC_PORT, "protocol": "TCP"},
            {"name": "metrics", "containerPort": METRICS_PORT, "protocol": "TCP"},
            {"name": "health", "containerPort": HEALTH_PORT, "protocol": "TCP"},
        ],
        # Mutual TLS: the component's certificate from the job's CA (src/kiln/operator/tls.py).
        "env": [*_env(job, component), {"name": "KILN_TLS_DIR", "value": TLS_DIR}, *extra_env,
                *settings.env],
        "resources": resources(res, extra_storage_bytes),
        **_grpc_probes(),
        "volumeMounts": [
            # subPath: a pod keeps the job file it started with; a change to the sections it
            # reads restarts it (config hash), a change elsewhere does not concern it.
            {"name": "job", "mountPath": JOB_FILE, "subPath": "job.yaml", "readOnly": True},
            {"name": "run", "mountPath": RUN_DIR},
            {"name": "tls", "mountPath": TLS_DIR, "readOnly": True},
            *extra_mounts,
        ],
        "securityContext": _service_security(),
    }
    if settings.env_from:
        container["envFrom"] = list(settings.env_from)
    return container


def _job_volume(job: JobRef) -> dict[str, Any]:
    return {"name": "job", "configMap": {"name": job.child("config")}}


def _scratch(res: Resources) -> dict[str, Any]:
    """An emptyDir bounded by the component's local-disk allowance (the kubelet evicts the pod
    past it, instead of the node's disk filling up)."""
    return {"emptyDir": {"sizeLimit": res.ephemeral_storage}}


def _model_volume(spec: RLJobSpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    """(volumes, mounts, env) for the model PVC, or nothing when the spec names none."""
    if spec.model.pvc is None:
        return [], [], []
    return (
        [{"name": "model", "persistentVolumeClaim": {"claimName": spec.model.pvc, "readOnly": True}}],
        [{"name": "model", "mountPath": MODEL_ROOT, "readOnly": True}],
        [{"name": "KILN_MODEL_ROOT", "value": MODEL_ROOT}],
    )


def model_init_container(spec: RLJobSpec, res: Resources) -> list[dict[str, Any]]:
    """`kiln prepare-model` before the service, when the spec asks for a model to be made
    (`spec.model.init`); it is deterministic, so every pod that makes one makes the same."""
    if spec.model.init is None:
        return []
    return [{
        "name": "prepare-model",
        "image": spec.image,
        "imagePullPolicy": "IfNotPresent",
        "command": ["kiln", "prepare-model", "--job", JOB_FILE],
        "resources": resources(res),
        "volumeMounts": [{"name": "job", "mountPath": JOB_FILE, "subPath": "job.yaml",
                          "readOnly": True}],
        "securityContext": _service_security(),
    }]


def pod_template(job: JobRef, spec: RLJobSpec, component: str, config_hash: str,
                 containers: list[dict[str, Any]], volumes: list[dict[str, Any]],
                 init_containers: list[dict[str, Any]] = (), grace_seconds: int = 30) -> dict[str, Any]:
    pod_spec: dict[str, Any] = {
        "automountServiceAccountToken": False,  # services never call the Kubernetes API
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": grace_seconds,
        "securityContext": {"fsGroup": SERVICE_UID},
        "containers": containers,
        # Group-readable: the files belong to root and the services run as SERVICE_UID, in fsGroup.
        "volumes": [*volumes, {"name": "tls", "secret": {"secretName": tls_secret_name(job, component),
                                                          "defaultMode": 0o440}}],
    }
    if init_containers:
        pod_spec["initContainers"] = list(init_containers)
    settings = pod_settings(spec, component)
    scheduling = {"nodeSelector": settings.node_selector, "tolerations": settings.tolerations,
                  "affinity": settings.affinity,
                  "imagePullSecrets": [{"name": n} for n in settings.image_pull_secrets],
                  "priorityClassName": settings.priority_class_name,
                  "serviceAccountName": settings.service_account_name}
    pod_spec.update({k: v for k, v in scheduling.items() if v})
    return {
        "metadata": {
            # Kiln's own labels last: the selector's labels cannot be overridden.
            "labels": {**settings.labels, **naming.labels(job, component, spec.image)},
            "annotations": {
                **settings.annotations,
                CONFIG_HASH: config_hash,
                "prometheus.io/scrape": "true",
                "prometheus.io/port": str(METRICS_PORT),
            },
        },
        "spec": pod_spec,
    }


def _deployment(job: JobRef, spec: RLJobSpec, component: str, replicas: int,
                template: dict[str, Any], recreate: bool = False) -> dict[str, Any]:
    body: dict[str, Any] = {
        "replicas": replicas,
        "selector": {"matchLabels": naming.selector_labels(job, component)},
        "template": template,
    }
    if recreate:
        # A ReadWriteOnce volume cannot be attached to the old and the new pod at once.
        body["strategy"] = {"type": "Recreate"}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": naming.metadata(job, component, spec.image),
        "spec": body,
    }


def _rendezvous_env(job: JobRef, replica: dict[str, str]) -> list[dict[str, Any]]:
    """Where the trainer's ranks meet: trainer pod 0, by its stable name under the trainer's
    headless Service (published before it is ready, as the ranks meet before that)."""
    host = f"{job.child('trainer')}-0.{job.child('trainer')}.{job.namespace}.svc"
    return [{"name": "MASTER_ADDR", "value": host},
            {"name": "MASTER_PORT", "value": str(RENDEZVOUS_PORT)}, replica]


def _trainer_statefulset(job: JobRef, spec: RLJobSpec, component: str, config_hash: str,
                         replicas: int, run_volume: dict[str, Any],
                         rendezvous: list[dict[str, Any]]) -> dict[str, Any]:
    volumes, mounts, env = _model_volume(spec)
    container = service_container(job, spec, "trainer", spec.trainer.resources, [*env, *rendezvous], mounts)
    if rendezvous:
        container["ports"].append({"name": "rendezvous", "containerPort": RENDEZVOUS_PORT, "protocol": "TCP"})
    template = pod_template(job, spec, "trainer", config_hash, [container],
                            [_job_volume(job), {"name": "run", **run_volume}, *volumes],
                            model_init_container(spec, spec.trainer.resources),
                            grace_seconds=120)  # room to write a checkpoint on SIGTERM
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
    rendezvous = _rendezvous_env(job, {"name": "KILN_TRAINER_REPLICA", "value": "0"}) if dp > 1 else []
    return _trainer_statefulset(job, spec, "trainer", config_hash, 1 if active else 0,
                                {"persistentVolumeClaim": {"claimName": job.child("checkpoints")}},
                                rendezvous)


def trainer_replicas(job: JobRef, spec: RLJobSpec, config_hash: str, active: bool) -> dict[str, Any] | None:
    """Data-parallel replicas 1..dp-1 (pod `-N` is replica N+1). They keep no checkpoints:
    replica 0 hands them its state when the ranks meet."""
    dp = spec.trainer.data_parallel
    if dp == 1:
        return None
    rendezvous = _rendezvous_env(job, {"name": "KILN_TRAINER_REPLICA_OFFSET", "value": "1"})
    return _trainer_statefulset(job, spec, TRAINER_REPLICAS, config_hash, dp - 1 if active else 0,
                                _scratch(spec.trainer.resources), rendezvous)


def rollout(job: JobRef, spec: RLJobSpec, config_hash: str, active: bool,
            frozen_addresses: list[dict[str, Any]] = ()) -> dict[str, Any]:
    """`frozen_addresses`: where its teachers, subagents and reward models are (`frozen.py`)."""
    volumes, mounts, env = _model_volume(spec)
    # Each replica its own task stream (the producer salts the job's seed with it); a pod scaled
    # away first lets its episodes finish (within the grace period below).
    env = [*env, {"name": "KILN_ROLLOUT_REPLICA", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
           {"name": "KILN_ROLLOUT_DRAIN_SECONDS", "value": "50"}, *frozen_addresses]
    container = service_container(job, spec, "rollout", spec.rollout.resources, env, mounts)
    if spec.rollout.openai_port:
        container["ports"].append({"name": "openai", "containerPort": spec.rollout.openai_port,
                                   "protocol": "TCP"})
    volumes = [_job_volume(job), {"name": "run", **_scratch(spec.rollout.resources)}, *volumes]
    template = pod_template(job, spec, "rollout", config_hash, [container], volumes,
                            model_init_container(spec, spec.rollout.resources), grace_seconds=60)
    return _deployment(job, spec, "rollout", spec.rollout.replicas if active else 0, template)


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
    volumes = [_job_volume(job), {"name": "run", **_scratch(spec.sandbox.resources)}]
    env: list[dict[str, Any]] = []
    mounts: list[dict[str, Any]] = []
    sidecars: list[dict[str, Any]] = []
    if docker:
        env = [{"name": "DOCKER_HOST", "value": f"unix://{DIND_SOCKET_DIR}/docker.sock"}]
        mounts = [{"name": "dind-socket", "mountPath": DIND_SOCKET_DIR}]
        volumes += [{"name": "dind-socket", "emptyDir": {}},
                    {"name": "dind-storage", **_scratch(spec.sandbox.resources)}]
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
    if hosting.runtime_class:
        template["spec"]["runtimeClassName"] = hosting.runtime_class
    return _deployment(job, spec, "sandbox", spec.sandbox.replicas if active else 0, template)


def weight_sync(job: JobRef, spec: RLJobSpec, config_hash: str, active: bool) -> dict[str, Any]:
    container = service_container(job, spec, "weight-sync", spec.weight_sync.resources)
    volumes = [_job_volume(job), {"name": "run", **_scratch(spec.weight_sync.resources)}]
    template = pod_template(job, spec, "weight-sync", config_hash, [container], volumes)
    return _deployment(job, spec, "weight-sync", 1 if active else 0, template)


def buffer(job: JobRef, spec: RLJobSpec, config_hash: str, active: bool) -> dict[str, Any]:
    container = service_container(job, spec, "buffer", spec.buffer.resources)
    volumes = [_job_volume(job),
               {"name": "run", "persistentVolumeClaim": {"claimName": job.child("buffer")}}]
    template = pod_template(job, spec, "buffer", config_hash, [container], volumes)
    return _deployment(job, spec, "buffer", 1 if active else 0, template, recreate=True)


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
