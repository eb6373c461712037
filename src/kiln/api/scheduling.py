"""Per-component pod settings of an RLJob (`spec.<component>.pod`): where a component's pods
may run and what they carry besides Kiln's own settings, as Kubeflow Trainer and KubeRay let
users say it. Part of the RLJob API; the operator renders them (`kiln.operator.workloads`), and
they are left out of the job file in the ConfigMap (services do not read them; env values stay
in the RLJob)."""
from __future__ import annotations

import posixpath
from typing import Annotated, Any

from pydantic import ConfigDict, Field, WithJsonSchema, field_validator, model_validator

from kiln.api.base import ByteQuantity, Model, quantity_value
from kiln.api.outputs import OUTPUT_ROOT

RESERVED_LABEL_PREFIXES = ("app.kubernetes.io/", "kiln.dev/")

KILN_PATHS = ("/etc/kiln", "/var/lib/kiln", OUTPUT_ROOT, "/models", "/dev/shm", "/run/dind")
"""Folders of a service container that Kiln mounts (the job file, task sources and TLS
certificates, the run directory, the output volume, the model volume, shared memory, the Docker
socket); a user's volume may not be mounted on, in or above any of them."""
KILN_VOLUMES = ("job", "run", "tls", "model", "openai-keys", "dind-socket", "dind-storage", "dshm",
                "output")
"""Volume names Kiln's pods use (a user's volume of the same name would replace one), besides
`tasks-<n>`, one per task source."""
_DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"


def _k8s(kind: str) -> Any:
    """A Kubernetes object passed through as written (the API server validates it)."""
    return Annotated[dict[str, Any], WithJsonSchema({
        "type": "object", "additionalProperties": True,
        "description": f"A Kubernetes {kind}, as in a pod spec."})]


class Volume(Model):
    """A Kubernetes volume, as in a pod spec: a name and one source (`persistentVolumeClaim`,
    `configMap`, `secret`, `emptyDir`, `nfs`, `csi`, `ephemeral`, ...), passed through as
    written; the API server validates the source."""

    model_config = ConfigDict(extra="allow")
    name: str = Field(pattern=_DNS_LABEL, max_length=63)
    """The name mounts refer to (not one of Kiln's own: job, run, tls, model, openai-keys,
    dind-socket, dind-storage, dshm, output, tasks-*)."""

    @field_validator("name")
    @classmethod
    def _not_kiln_s(cls, value: str) -> str:
        if value in KILN_VOLUMES or value.startswith("tasks-"):
            raise ValueError(f"{value!r} is a volume Kiln's pods use; pick another name "
                             f"(taken: {', '.join(KILN_VOLUMES)}, tasks-*)")
        return value

    @model_validator(mode="after")
    def _no_host_path(self) -> "Volume":
        # Whoever may create an RLJob would otherwise read and write the node's own files
        # through the operator's pods.
        if "hostPath" in (self.model_extra or {}):
            raise ValueError(f"volume {self.name!r}: hostPath volumes are not allowed (they expose "
                             "the node's files); use a persistentVolumeClaim, nfs or csi volume")
        return self


class VolumeMount(Model):
    """Where one of `volumes` appears in the component's service container."""

    name: str = Field(pattern=_DNS_LABEL, max_length=63)
    """The volume's name (one of `volumes`)."""
    mount_path: str = Field(pattern=r"^/", max_length=1024)
    """Absolute path in the container; not on, in or above a folder Kiln mounts (/etc/kiln,
    /var/lib/kiln, /var/lib/kiln-output, /models, /dev/shm, /run/dind)."""
    sub_path: str | None = Field(None, max_length=1024)
    """A path inside the volume to mount instead of its root."""
    read_only: bool = False
    """Mount it read-only."""

    @field_validator("mount_path")
    @classmethod
    def _not_over_kiln_s(cls, value: str) -> str:
        path = posixpath.normpath(value)
        for own in KILN_PATHS:
            if path == own or path.startswith(own + "/") or own.startswith(path.rstrip("/") + "/"):
                raise ValueError(f"{value} overlaps {own}, which Kiln mounts; mount elsewhere "
                                 f"(not on, in or above {', '.join(KILN_PATHS)})")
        return value


class PodSettings(Model):
    """Scheduling, identity and environment of one component's pods."""

    node_selector: dict[str, str] = Field(default_factory=dict)
    """Node labels the pods require (e.g. `nvidia.com/gpu.product: NVIDIA-H100-80GB-HBM3`)."""
    tolerations: list[_k8s("Toleration")] = Field(default_factory=list)
    """Kubernetes tolerations, e.g. `{key: nvidia.com/gpu, operator: Exists, effect: NoSchedule}`
    for tainted GPU nodes."""
    affinity: dict[str, Any] | None = None
    """A Kubernetes affinity (node, pod, anti-affinity), as in a pod spec."""
    image_pull_secrets: list[str] = Field(default_factory=list)
    """Names of Secrets holding registry credentials."""
    env: list[_k8s("EnvVar")] = Field(default_factory=list)
    """Extra environment variables, as Kubernetes EnvVars; put secrets in
    `valueFrom.secretKeyRef` (e.g. an HF token), not in `value`."""
    env_from: list[_k8s("EnvFromSource")] = Field(default_factory=list)
    """Whole Secrets or ConfigMaps as environment (`secretRef`, `configMapRef`)."""
    priority_class_name: str | None = None
    """The pods' PriorityClass."""
    service_account_name: str | None = None
    """The pods' ServiceAccount (e.g. for cloud workload identity); its token is not mounted,
    as the services never call the Kubernetes API."""
    labels: dict[str, str] = Field(default_factory=dict)
    """Extra pod labels (not under app.kubernetes.io/ or kiln.dev/, which Kiln sets)."""
    annotations: dict[str, str] = Field(default_factory=dict)
    """Extra pod annotations."""
    volumes: list[Volume] = Field(default_factory=list, max_length=32)
    """Extra volumes of these pods (a dataset PVC, a Secret of files, an NFS share), mounted
    by `volumeMounts`."""
    volume_mounts: list[VolumeMount] = Field(default_factory=list, max_length=32)
    """Where `volumes` appear in the component's service container."""

    @model_validator(mode="after")
    def _mounts_name_volumes(self) -> "PodSettings":
        names = [v.name for v in self.volumes]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(f"volumes: names must be unique; repeated: {', '.join(repeated)}")
        paths = [posixpath.normpath(m.mount_path) for m in self.volume_mounts]
        for i, mount in enumerate(self.volume_mounts):
            if mount.name not in names:
                raise ValueError(f"volumeMounts[{i}].name: {mount.name!r} is not one of volumes "
                                 f"(declared: {', '.join(names) or 'none'})")
            if paths.count(paths[i]) > 1:
                raise ValueError(f"volumeMounts[{i}].mountPath: {mount.mount_path} is mounted twice")
        return self

    @field_validator("labels", "annotations")
    @classmethod
    def _not_reserved(cls, value: dict[str, str]) -> dict[str, str]:
        taken = sorted(k for k in value if k.startswith(RESERVED_LABEL_PREFIXES))
        if taken:
            raise ValueError(f"{', '.join(taken)}: keys under app.kubernetes.io/ and kiln.dev/ "
                             f"are set by Kiln")
        return value

    @field_validator("env")
    @classmethod
    def _env_named(cls, value: list[dict[str, Any]]) -> list[dict[str, Any]]:
        for i, var in enumerate(value):
            name = var.get("name")
            if not isinstance(name, str) or not name:
                raise ValueError(f"env[{i}]: every variable needs a name")
            if name.startswith("KILN_"):
                raise ValueError(f"env[{i}] {name}: KILN_* variables are set by Kiln")
            if "value" not in var and "valueFrom" not in var:
                raise ValueError(f"env[{i}] {name}: needs value or valueFrom")
        return value


class EnginePodSettings(PodSettings):
    """Pod settings of the components that run a model (rollout's engines, the trainer)."""

    shm_size: ByteQuantity = "1Gi"
    """Size of the pod's memory-backed /dev/shm (vLLM's workers and NCCL exchange tensors
    through it; a container's own is 64Mi). What is used counts towards `resources.memory`,
    so it may not exceed it."""


def shm_fits(memory: str, pod: EnginePodSettings) -> None:
    """Refuse a /dev/shm larger than the memory limit that pays for it."""
    if quantity_value(pod.shm_size) > quantity_value(memory):
        raise ValueError(f"pod.shmSize ({pod.shm_size}) exceeds resources.memory ({memory}): "
                         "/dev/shm is memory, counted in the pod's limit")
