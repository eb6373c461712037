"""What an RLJob may reference: the operator's allowlists refuse, by field, every Secret,
ServiceAccount and image beyond them, Kiln's own certificate Secrets always, and tolerations
that would put a job's pods on control-plane nodes."""
from __future__ import annotations

import pytest

from kiln.operator.config import OperatorConfig
from kiln.operator.policy import Allowlist, normalized_image

from helpers.operator_jobs import FULL, SMALL, spec

NOTHING = Allowlist(service_accounts=(), image_registries=(), secrets=())


def fields(lines: list[str]) -> list[str]:
    return [line.split(":")[0] for line in lines]


def test_every_reference_beyond_the_lists_is_refused_by_field() -> None:
    job = spec(FULL, **{"sandbox__pod": {"volumes": [
        {"name": "creds", "secret": {"secretName": "aws"}},
        {"name": "mixed", "projected": {"sources": [{"secret": {"name": "gcp"}}]}}]}})
    assert fields(NOTHING.refusals(job)) == [
        "image", "sandbox.image", "rollout.openai.apiKeySecret", "trainer.pod.imagePullSecrets[0]",
        "trainer.pod.env[0].valueFrom.secretKeyRef.name", "trainer.pod.envFrom[0].secretRef.name",
        "sandbox.pod.volumes[0].secret.secretName",
        "sandbox.pod.volumes[1].projected.sources[0].secret.name", "trainer.pod.serviceAccountName"]
    allowed = Allowlist(service_accounts=("kiln-*",),
                        image_registries=("registry.example.com/", "docker.io/library/"),
                        secrets=("agents", "registry", "hf", "wandb", "aws", "gcp"))
    assert allowed.refusals(job) == []
    assert Allowlist().refusals(job) == []  # "*" everywhere: anything goes
    assert NOTHING.refusals(spec(SMALL, image="ghcr.io/kiln-dev/kiln:1")) == [
        "image: image 'ghcr.io/kiln-dev/kiln:1' is not from a registry this operator allows "
        "(allowed: none; the chart's operator.allowed.imageRegistries)"]


def test_kiln_certificate_secrets_and_the_control_plane_are_refused_whatever_the_lists() -> None:
    job = spec(SMALL, **{"rollout__pod": {
        "env": [{"name": "K", "valueFrom": {"secretKeyRef": {"name": "other-job-ca", "key": "ca.key"}}}],
        "envFrom": [{"secretRef": {"name": "other-job-trainer-tls"}}],
        "tolerations": [{"key": "node-role.kubernetes.io/control-plane", "operator": "Exists"},
                        {"operator": "Exists"},
                        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]}})
    refused = Allowlist().refusals(job)
    assert fields(refused) == ["rollout.pod.env[0].valueFrom.secretKeyRef.name",
                               "rollout.pod.envFrom[0].secretRef.name",
                               "rollout.pod.tolerations[0]", "rollout.pod.tolerations[1]"]
    assert "certificate Secret" in refused[0] and "every taint" in refused[3]


def test_images_are_matched_with_dockers_defaults_and_prefixes_end_in_a_slash() -> None:
    assert normalized_image("python:3.12") == "docker.io/library/python:3.12"
    assert normalized_image("me/app:1") == "docker.io/me/app:1"
    assert normalized_image("localhost:5000/app") == "localhost:5000/app"
    ghcr = Allowlist(image_registries=("ghcr.io/kiln-dev/",))
    assert ghcr.image_allowed("ghcr.io/kiln-dev/kiln:0.1.0")
    assert not ghcr.image_allowed("ghcr.io/kiln-dev-evil/kiln:0.1.0")
    with pytest.raises(ValueError, match="KILN_OPERATOR_ALLOWED_IMAGE_REGISTRIES"):
        OperatorConfig.from_env({"KILN_OPERATOR_ALLOWED_IMAGE_REGISTRIES": '["ghcr.io/kiln"]'})
    with pytest.raises(ValueError, match="KILN_OPERATOR_ALLOWED_SECRETS: a JSON list"):
        OperatorConfig.from_env({"KILN_OPERATOR_ALLOWED_SECRETS": "hf"})
