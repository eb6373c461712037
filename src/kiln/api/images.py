"""Kiln's own images and the registry they come from.

The release workflow (`.github/workflows/release.yaml`) builds four images from
`deploy/docker/` and pushes them, tagged with the chart's appVersion, to one registry:
`kiln-operator`, `kiln` (the services, CPU), `kiln:<version>-cuda` and `kiln-sandbox-base`. The
chart's `image.registry` names that registry; the operator runs an RLJob whose `spec.image` is
Kiln's default (left unset, or spelled out) from it (`from_registry`), so pointing a cluster at a
mirror or a team's own build is one chart value. An image the job names otherwise is its own.
Torch-free.
"""
from __future__ import annotations

from kiln.api.spec import RLJobSpec

DEFAULT_REGISTRY = "ghcr.io/kiln-dev"
"""Where Kiln's released images are published."""
IMAGES = {"operator": "kiln-operator", "services": "kiln", "sandbox": "kiln-sandbox-base"}
"""Repository names of Kiln's images, under a registry."""


def default_image() -> str:
    """`spec.image` when a job leaves it out: the CPU services image of this version."""
    return RLJobSpec.model_fields["image"].default


def from_registry(spec: RLJobSpec, registry: str | None) -> RLJobSpec:
    """`spec` with Kiln's default services image (or its `-cuda` variant) taken from
    `registry` (`host[:port]/path`, no trailing `/`); unchanged for any other image."""
    if not registry or registry.rstrip("/") == DEFAULT_REGISTRY:
        return spec
    default = default_image()
    prefix = f"{DEFAULT_REGISTRY}/"
    if spec.image not in (default, f"{default}-cuda"):
        return spec
    return spec.model_copy(update={"image": f"{registry.rstrip('/')}/{spec.image.removeprefix(prefix)}"})
