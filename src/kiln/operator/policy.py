"""What an RLJob may reference on a cluster: the operator's allowlists for ServiceAccounts,
image registries and Secret names, and the node roles it may not tolerate its way onto.

An RLJob's author writes fields that reach pod specs (images, `pod.serviceAccountName`,
`pod.env`/`envFrom`, `pod.volumes`, `imagePullSecrets`, tolerations, the Hub token and API key
Secrets). Unfiltered, creating an RLJob would give its author every Secret of the namespace
(other jobs' CA keys among them), any ServiceAccount's cloud identity, any image, and the
control-plane nodes. `refusals` names each field of a spec that goes beyond the cluster
admin's allowlists (the chart's `operator.allowed`, rendered into the operator's
environment); the job is then refused (reason NotAllowed) and nothing of it is applied.

Patterns: a Secret or ServiceAccount name, or a glob of them (`hf-*`); an image registry
prefix ending in `/` (`ghcr.io/kiln-dev/`), matched against the image reference with Docker's
defaults filled in (`python:3.12` is `docker.io/library/python:3.12`); `*` allows any.
Whatever the lists say, the certificate Secrets Kiln makes for jobs (`<job>-ca`,
`<job>-<component>-tls`) cannot be referenced, and tolerating the control plane's taints (or
every taint) is refused.

Not covered: what an allowed image or ServiceAccount can do once running (that is the
allowlist's point: an admin decides), and ConfigMaps (no credentials in them).
"""
from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass
from typing import Any, Iterator

from kiln.api.spec import RLJobSpec

ANY = "*"
CONTROL_PLANE_TAINTS = ("node-role.kubernetes.io/control-plane", "node-role.kubernetes.io/master")
# The Secrets `kiln.operator.tls` makes: no author's pod may read another job's keys.
_KILN_SECRET = re.compile(r".+-(ca|(trainer|rollout|sandbox|weight-sync|buffer|teacher)-tls)$")
# Spec attribute, camelCase field name of each component that has pod settings.
_PODS = (("rollout", "rollout"), ("trainer", "trainer"), ("sandbox", "sandbox"),
         ("weight_sync", "weightSync"), ("buffer", "buffer"))


def normalized_image(image: str) -> str:
    """`image` with Docker's implied registry and namespace: `python:3.12` ->
    `docker.io/library/python:3.12`, `me/app` -> `docker.io/me/app`."""
    first, _, rest = image.partition("/")
    if rest and ("." in first or ":" in first or first == "localhost"):
        return image
    return f"docker.io/{image}" if rest else f"docker.io/library/{image}"


def check_registry_prefix(prefix: str) -> str:
    """A registry prefix as the settings take it; ValueError otherwise."""
    if prefix != ANY and not prefix.endswith("/"):
        raise ValueError(f"image registry prefix {prefix!r} must end with '/' (or be '*'): "
                         f"'ghcr.io/kiln' would also allow 'ghcr.io/kiln-other/...'")
    return prefix


@dataclass(frozen=True)
class Allowlist:
    service_accounts: tuple[str, ...] = (ANY,)
    image_registries: tuple[str, ...] = (ANY,)
    secrets: tuple[str, ...] = (ANY,)

    def image_allowed(self, image: str) -> bool:
        ref = normalized_image(image)
        return any(p == ANY or ref.startswith(p) for p in self.image_registries)

    def refusals(self, spec: RLJobSpec) -> list[str]:
        """One "field: reason" line per reference beyond the allowlists."""
        out = []
        for field, image in _images(spec):
            if not self.image_allowed(image):
                out.append(f"{field}: image {image!r} is not from a registry this operator allows "
                           f"({_listed(self.image_registries)}; the chart's "
                           "operator.allowed.imageRegistries)")
        for field, name in _secrets(spec):
            if _KILN_SECRET.fullmatch(name):
                out.append(f"{field}: Secret {name!r} looks like a job certificate Secret Kiln "
                           "makes (<job>-ca, <job>-<component>-tls); jobs cannot reference those")
            elif not _matches(name, self.secrets):
                out.append(f"{field}: Secret {name!r} is not one jobs may reference "
                           f"({_listed(self.secrets)}; the chart's operator.allowed.secrets)")
        for field, name in _service_accounts(spec):
            if not _matches(name, self.service_accounts):
                out.append(f"{field}: ServiceAccount {name!r} is not one jobs may use "
                           f"({_listed(self.service_accounts)}; the chart's "
                           "operator.allowed.serviceAccounts)")
        for field, toleration in _tolerations(spec):
            key = toleration.get("key")
            if key in CONTROL_PLANE_TAINTS or (not key and toleration.get("operator") == "Exists"):
                out.append(f"{field}: tolerates {key or 'every taint'}, which would schedule the "
                           "job's pods on control-plane nodes; name the taints of the nodes "
                           "meant for it")
        return out


def _matches(name: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def _listed(patterns: tuple[str, ...]) -> str:
    return "allowed: " + (", ".join(patterns) if patterns else "none")


def _images(spec: RLJobSpec) -> Iterator[tuple[str, str]]:
    yield "image", spec.image
    if spec.sandbox.image:
        yield "sandbox.image", spec.sandbox.image


def _pods(spec: RLJobSpec) -> Iterator[tuple[str, Any]]:
    for attr, field in _PODS:
        yield f"{field}.pod", getattr(spec, attr).pod


def _secrets(spec: RLJobSpec) -> Iterator[tuple[str, str]]:
    if spec.model.hub is not None and spec.model.hub.token_secret:
        yield "model.hub.tokenSecret", spec.model.hub.token_secret
    for i, ts in enumerate(spec.tasks):
        if ts.source is not None and ts.source.hf_dataset is not None and ts.source.hf_dataset.token_secret:
            yield f"tasks[{i}].source.hfDataset.tokenSecret", ts.source.hf_dataset.token_secret
    if spec.rollout.openai.api_key_secret:
        yield "rollout.openai.apiKeySecret", spec.rollout.openai.api_key_secret
    for field, pod in _pods(spec):
        for i, name in enumerate(pod.image_pull_secrets):
            yield f"{field}.imagePullSecrets[{i}]", name
        for i, var in enumerate(pod.env):
            ref = ((var.get("valueFrom") or {}).get("secretKeyRef") or {}).get("name")
            if ref:
                yield f"{field}.env[{i}].valueFrom.secretKeyRef.name", ref
        for i, source in enumerate(pod.env_from):
            ref = (source.get("secretRef") or {}).get("name")
            if ref:
                yield f"{field}.envFrom[{i}].secretRef.name", ref
        for i, volume in enumerate(pod.volumes):
            extra = volume.model_extra or {}
            ref = (extra.get("secret") or {}).get("secretName")
            if ref:
                yield f"{field}.volumes[{i}].secret.secretName", ref
            for j, source in enumerate((extra.get("projected") or {}).get("sources") or []):
                ref = (source.get("secret") or {}).get("name")
                if ref:
                    yield f"{field}.volumes[{i}].projected.sources[{j}].secret.name", ref


def _service_accounts(spec: RLJobSpec) -> Iterator[tuple[str, str]]:
    for field, pod in _pods(spec):
        if pod.service_account_name:
            yield f"{field}.serviceAccountName", pod.service_account_name


def _tolerations(spec: RLJobSpec) -> Iterator[tuple[str, dict[str, Any]]]:
    for field, pod in _pods(spec):
        for i, toleration in enumerate(pod.tolerations):
            yield f"{field}.tolerations[{i}]", toleration
