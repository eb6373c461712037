"""The building blocks of an RLJob's pods, as pure functions: a service container (its command,
resources, probes, peers' addresses, unprivileged security context), the model volume and the
init container that gets the model there, and the pod template and Deployment around them.
`kiln.operator.workloads` assembles the job's workloads from them; `kiln.operator.frozen` its
frozen deployments.
"""
from __future__ import annotations

from typing import Any

from kiln.api.base import quantity_value
from kiln.api.ports import HEALTH_PORT
from kiln.api.scheduling import EnginePodSettings, PodSettings
from kiln.api.spec import Resources, RLJobSpec
from kiln.operator import naming
from kiln.operator.naming import (CONFIG_HASH, GRPC_PORT, JOB_FILE, METRICS_PORT, MODEL_ROOT,
                                  RUN_DIR, JobRef)
from kiln.operator.tls import tls_secret_name

TLS_DIR = "/etc/kiln/tls"
SHM_DIR = "/dev/shm"
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
        # An extended resource: set as a limit, the request follows it.
        limits[res.gpu_resource] = res.gpu
    return {"requests": amounts, "limits": limits}


def grpc_probes() -> dict[str, Any]:
    # The kubelet's gRPC probes speak plain text: they go to the health-only port.
    probe = {"grpc": {"port": HEALTH_PORT}}
    return {
        # Loading a model or replaying a buffer can take minutes; liveness starts after that.
        "startupProbe": {**probe, "periodSeconds": 10, "failureThreshold": 90, "timeoutSeconds": 5},
        "readinessProbe": {**probe, "periodSeconds": 5, "failureThreshold": 2, "timeoutSeconds": 5},
        "livenessProbe": {**probe, "periodSeconds": 20, "failureThreshold": 3, "timeoutSeconds": 5},
    }


def service_env(job: JobRef, component: str) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [
        {"name": "KILN_JOB_NAME", "value": job.name},
        {"name": "KILN_COMPONENT", "value": component},
        {"name": "KILN_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        {"name": "KILN_POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
    ]
    env += [{"name": naming.addr_env_name(c), "value": naming.component_address(job, c)}
            for c in naming.COMPONENTS]
    return env


def service_security() -> dict[str, Any]:
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
        "env": [*service_env(job, component), {"name": "KILN_TLS_DIR", "value": TLS_DIR}, *extra_env,
                *settings.env],
        "resources": resources(res, extra_storage_bytes),
        **grpc_probes(),
        "volumeMounts": [
            # subPath: a pod keeps the job file it started with; a change to the sections it
            # reads restarts it (config hash), a change elsewhere does not concern it.
            {"name": "job", "mountPath": JOB_FILE, "subPath": "job.yaml", "readOnly": True},
            {"name": "run", "mountPath": RUN_DIR},
            {"name": "tls", "mountPath": TLS_DIR, "readOnly": True},
            *extra_mounts,
            *shm(settings)[1],
            *(m.model_dump(by_alias=True, exclude_none=True) for m in settings.volume_mounts),
        ],
        "securityContext": service_security(),
    }
    if settings.env_from:
        container["envFrom"] = list(settings.env_from)
    return container


def shm(settings: PodSettings) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(volumes, mounts) of a memory-backed /dev/shm for the pods that run a model (vLLM's
    workers and NCCL pass tensors through it; a container's own is 64Mi); none for others."""
    if not isinstance(settings, EnginePodSettings):
        return [], []
    return ([{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": settings.shm_size}}],
            [{"name": "dshm", "mountPath": SHM_DIR}])


def job_volume(job: JobRef) -> dict[str, Any]:
    return {"name": "job", "configMap": {"name": job.child("config")}}


def scratch(res: Resources) -> dict[str, Any]:
    """An emptyDir bounded by the component's local-disk allowance (the kubelet evicts the pod
    past it, instead of the node's disk filling up)."""
    return {"emptyDir": {"sizeLimit": res.ephemeral_storage}}


def model_volume(spec: RLJobSpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    """(volumes, mounts, env) for the model PVC, or nothing when the spec names none. The
    services mount it read-only; the volume itself is writable when the model is made or
    downloaded onto it first (`model_init_container`)."""
    if spec.model.pvc is None:
        return [], [], []
    prepared = spec.model.init is not None or spec.model.hub is not None
    return (
        [{"name": "model", "persistentVolumeClaim": {"claimName": spec.model.pvc,
                                                     "readOnly": not prepared}}],
        [{"name": "model", "mountPath": MODEL_ROOT, "readOnly": True}],
        [{"name": "KILN_MODEL_ROOT", "value": MODEL_ROOT}],
    )


def model_init_container(spec: RLJobSpec, res: Resources) -> list[dict[str, Any]]:
    """`kiln prepare-model` before the service, when the spec asks for a model to be made
    (`spec.model.init`: deterministic, so every pod that makes one makes the same) or downloaded
    (`spec.model.hub`: resumed if a previous try stopped, skipped once recorded complete). It
    writes where the service reads: the model PVC (`spec.model.pvc`), else the pod's run volume."""
    model = spec.model
    if model.init is None and model.hub is None:
        return []
    mounts = [{"name": "job", "mountPath": JOB_FILE, "subPath": "job.yaml", "readOnly": True},
              {"name": "run", "mountPath": RUN_DIR}]
    env: list[dict[str, Any]] = []
    if model.pvc is not None:
        mounts.append({"name": "model", "mountPath": MODEL_ROOT})
        env.append({"name": "KILN_MODEL_ROOT", "value": MODEL_ROOT})
    if model.hub is not None:
        # huggingface_hub's own files (its token cache, xet chunks) on a writable volume.
        env.append({"name": "HF_HOME", "value": f"{RUN_DIR}/.cache/huggingface"})
        if model.hub.token_secret:
            env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {
                "name": model.hub.token_secret, "key": "token"}}})
    return [{
        "name": "prepare-model",
        "image": spec.image,
        "imagePullPolicy": "IfNotPresent",
        "command": ["kiln", "prepare-model", "--job", JOB_FILE],
        "workingDir": RUN_DIR,
        "env": env,
        "resources": resources(res),
        "volumeMounts": mounts,
        "securityContext": service_security(),
    }]


def pod_template(job: JobRef, spec: RLJobSpec, component: str, config_hash: str,
                 containers: list[dict[str, Any]], volumes: list[dict[str, Any]],
                 init_containers: list[dict[str, Any]] = (), grace_seconds: int = 30) -> dict[str, Any]:
    settings = pod_settings(spec, component)
    pod_spec: dict[str, Any] = {
        "automountServiceAccountToken": False,  # services never call the Kubernetes API
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": grace_seconds,
        "securityContext": {"fsGroup": SERVICE_UID},
        "containers": containers,
        # Group-readable: the files belong to root and the services run as SERVICE_UID, in fsGroup.
        "volumes": [*volumes, {"name": "tls", "secret": {"secretName": tls_secret_name(job, component),
                                                          "defaultMode": 0o440}},
                    *shm(settings)[0],
                    *(v.model_dump(by_alias=True, exclude_none=True) for v in settings.volumes)],
    }
    if init_containers:
        pod_spec["initContainers"] = list(init_containers)
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


def deployment(job: JobRef, spec: RLJobSpec, component: str, replicas: int,
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
