"""Operator settings read from the environment (`KILN_OPERATOR_*`), typed with pydantic.

The Helm chart sets these on the operator Deployment; tests set them before starting the
operator. Kopf's own settings (finalizer, storages, peering) are fixed in the startup handler.

Not covered: per-job settings, which live in the RLJob spec.
"""
from __future__ import annotations

import datetime
import json
import os

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from kiln.api.images import DEFAULT_REGISTRY
from kiln.operator.policy import ANY, Allowlist, check_registry_prefix
from kiln.operator.status import DEFAULT_ADDRESS
from kiln.operator.tls import Lifetimes
from kiln.tls import CA_LIFETIME, CERT_LIFETIME
from kiln.operator.workloads import DIND_IMAGE, SandboxHosting

PREFIX = "KILN_OPERATOR_"
HOUR = datetime.timedelta(hours=1)


class OperatorConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    status_interval: float = Field(15.0, gt=0)
    """Seconds between status refreshes of each running job."""
    grpc_timeout: float = Field(2.0, gt=0)
    """Deadline of one health or status RPC to a job's service."""
    address_template: str = DEFAULT_ADDRESS
    """gRPC address of a job's component; {name}, {namespace} and {component} are filled in."""
    repair_interval: float = Field(30.0, gt=0)
    """Seconds between re-applies of each job's children (drift repair)."""
    unavailable_seconds: float = Field(900.0, gt=0)
    """How long the stage driver waits for a job's service that does not answer before it
    fails the job."""
    address_map: str = ""
    """A JSON file mapping "namespace/service" to host:port, consulted before the template
    (written by the development cluster's node agent; empty in a real cluster)."""
    tracking_dir: str = "/tmp/kiln-tracking"
    """Where the stage driver writes each job's TensorBoard event files
    (`<namespace>/<job>/driver` inside it); the chart mounts an emptyDir at
    /var/lib/kiln-tracking and points this there (a persistent volume keeps them past a restart
    of the operator). Empty: the driver writes none (W&B, when a job asks for it, still runs)."""
    dind_image: str = DIND_IMAGE
    """Docker-in-pod sidecar image for sandboxes with the docker backend."""
    allow_privileged_sandboxes: bool = False
    """Let RLJobs run sandbox pods privileged on the nodes' own kernel (bubblewrap needs root
    for cgroups and mounts; docker a privileged dind sidecar): whoever may create an RLJob is
    then root on the nodes that run its sandbox pods. Off, and with no `sandbox_runtime_class`,
    a job with sandboxes is refused (reason NotAllowed) and nothing of it is applied."""
    sandbox_runtime_class: str = ""
    """RuntimeClass for sandbox pods that gives each pod a kernel of its own (Kata Containers,
    gVisor): the privileges the sandboxes need then stay inside the pod's VM, and jobs with
    sandboxes are admitted without `allow_privileged_sandboxes`."""

    cert_lifetime_hours: float = Field(CERT_LIFETIME / HOUR, gt=0)
    """Lifetime of each job's component certificates; renewed (and the job's pods restarted)
    at two thirds of it."""
    ca_lifetime_hours: float = Field(CA_LIFETIME / HOUR, gt=0)
    """Lifetime of each job's CA; rotated at two thirds of it."""
    ca_overlap_hours: float = Field(24.0, gt=0)
    """How long a job's new CA is trusted before it signs: must outlast one restart of all the
    job's pods (they pick up the trust bundle that holds it)."""

    image_registry: str = Field(DEFAULT_REGISTRY, pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?(:[0-9]+)?(/[-a-z0-9._]+)*$")
    """Registry of Kiln's images (the chart's `image.registry`): an RLJob whose image is Kiln's
    default runs it from there (`kiln.api.images.from_registry`)."""
    allowed_service_accounts: list[str] = [ANY]
    """ServiceAccounts (names or globs) RLJobs may run their pods as (`pod.serviceAccountName`);
    `*`: any. A JSON list in the environment."""
    allowed_image_registries: list[str] = [ANY]
    """Image registry prefixes (ending in `/`) RLJobs' images may come from; `*`: any."""
    allowed_secrets: list[str] = [ANY]
    """Secrets (names or globs) RLJobs may reference (env, envFrom, volumes, imagePullSecrets,
    the Hub token, the OpenAI API keys); `*`: any. Kiln's own certificate Secrets never."""

    @field_validator("allowed_image_registries")
    @classmethod
    def _prefixes(cls, value: list[str]) -> list[str]:
        return [check_registry_prefix(p) for p in value]

    @model_validator(mode="after")
    def _lifetimes_fit(self) -> OperatorConfig:
        if self.cert_lifetime_hours >= self.ca_lifetime_hours:
            raise ValueError("cert_lifetime_hours must be shorter than ca_lifetime_hours")
        if self.ca_overlap_hours >= self.ca_lifetime_hours / 3:
            raise ValueError("ca_overlap_hours must be under a third of ca_lifetime_hours (the "
                             "old CA expires a third of its lifetime after the rotation starts)")
        return self

    @property
    def lifetimes(self) -> Lifetimes:
        return Lifetimes(cert=self.cert_lifetime_hours * HOUR, ca=self.ca_lifetime_hours * HOUR,
                         overlap=self.ca_overlap_hours * HOUR)

    @property
    def allowlist(self) -> Allowlist:
        return Allowlist(tuple(self.allowed_service_accounts), tuple(self.allowed_image_registries),
                         tuple(self.allowed_secrets))

    @property
    def hosting(self) -> SandboxHosting:
        return SandboxHosting(dind_image=self.dind_image, runtime_class=self.sandbox_runtime_class)

    def refusals(self, spec) -> list[str]:
        """What this operator will not run of an accepted spec (kiln.api.spec.RLJobSpec)."""
        return (self._sandbox_refusals(spec) + self._openai_refusals(spec)
                + self.allowlist.refusals(spec))

    @staticmethod
    def _openai_refusals(spec) -> list[str]:
        if not spec.rollout.openai_port or spec.rollout.openai.api_key_secret:
            return []
        return ["rollout.openaiPort: the OpenAI endpoint serves only callers with an API key; name "
                "a Secret of this namespace holding them in rollout.openai.apiKeySecret"]

    def _sandbox_refusals(self, spec) -> list[str]:
        if spec.sandbox.replicas == 0 or self.allow_privileged_sandboxes or self.sandbox_runtime_class:
            return []
        need = ("a privileged Docker-in-pod sidecar" if spec.sandbox.backend == "docker"
                else "a privileged container (cgroups for the limits, mounts for the disk quota)")
        return [f"sandbox: the {spec.sandbox.backend} backend needs {need}, which this operator "
                "does not allow on the nodes' own kernel; the cluster admin can set the chart's "
                "operator.sandboxRuntimeClass (e.g. kata: a VM per sandbox pod) or "
                "operator.allowPrivilegedSandboxes (whoever can create an RLJob is then root on "
                "the sandbox nodes); spec.sandbox.replicas 0 runs no sandboxes"]

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> OperatorConfig:
        env = os.environ if environ is None else environ
        values: dict[str, object] = {name: env[PREFIX + name.upper()] for name in cls.model_fields
                                     if PREFIX + name.upper() in env}
        try:
            for name in ("allowed_service_accounts", "allowed_image_registries", "allowed_secrets"):
                if name in values:
                    try:
                        values[name] = json.loads(str(values[name]))
                    except ValueError:
                        raise ValueError(f"invalid operator setting {PREFIX + name.upper()}: a JSON "
                                         f"list of strings is expected, got {values[name]!r}") from None
            return cls.model_validate(values)
        except ValidationError as exc:
            names = ", ".join(PREFIX + str(e["loc"][0]).upper() for e in exc.errors())
            raise ValueError(f"invalid operator setting(s) {names}: {exc}") from exc
