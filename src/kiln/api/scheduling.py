"""Per-component pod settings of an RLJob (`spec.<component>.pod`): where a component's pods
may run and what they carry besides Kiln's own settings, as Kubeflow Trainer and KubeRay let
users say it. Part of the RLJob API; the operator renders them (`kiln.operator.workloads`), and
they are left out of the job file in the ConfigMap (services do not read them; env values stay
in the RLJob)."""
from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field, WithJsonSchema, field_validator

from kiln.api.base import Model

RESERVED_LABEL_PREFIXES = ("app.kubernetes.io/", "kiln.dev/")


def _k8s(kind: str) -> Any:
    """A Kubernetes object passed through as written (the API server validates it)."""
    return Annotated[dict[str, Any], WithJsonSchema({
        "type": "object", "additionalProperties": True,
        "description": f"A Kubernetes {kind}, as in a pod spec."})]


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
