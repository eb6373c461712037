"""Image names agree across the RLJob default, the chart, the examples and the Dockerfiles."""
from __future__ import annotations

from pathlib import Path

import yaml

from kiln.api.spec import RLJobSpec

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "deploy" / "docker"


def _first_line(name: str) -> str:
    return (DOCKER / name).read_text().splitlines()[0]


def test_service_image_default_is_built_by_the_services_dockerfile() -> None:
    default = RLJobSpec.model_fields["image"].default
    assert default == "ghcr.io/kiln-dev/kiln:0.1.0"
    assert "ghcr.io/kiln-dev/kiln:" in _first_line("services.Dockerfile")
    assert f"-t {default} ." in (DOCKER / "services.Dockerfile").read_text()


def test_chart_operator_image_is_built_by_the_operator_dockerfile() -> None:
    values = yaml.safe_load((ROOT / "charts" / "kiln" / "values.yaml").read_text())
    chart = yaml.safe_load((ROOT / "charts" / "kiln" / "Chart.yaml").read_text())
    image = (f"{values['image']['registry']}/{values['image']['repository']}:"
             f"{values['image']['tag'] or chart['appVersion']}")
    assert image == "ghcr.io/kiln-dev/kiln-operator:0.1.0"
    text = (DOCKER / "operator.Dockerfile").read_text()
    assert f"-t {image} ." in text and 'ENTRYPOINT ["kiln-operator"]' in text
    assert chart["appVersion"] == RLJobSpec.model_fields["image"].default.rsplit(":", 1)[1]


def test_examples_use_published_images() -> None:
    sandbox_base = (DOCKER / "sandbox-base.Dockerfile").read_text()
    default = RLJobSpec.model_fields["image"].default
    for path in (ROOT / "deploy" / "examples").glob("*.yaml"):
        spec = yaml.safe_load(path.read_text())["spec"]
        if "image" in spec:
            # The CPU image, or the CUDA one for GPU jobs.
            assert spec["image"] in (default, f"{default}-cuda"), path.name
            if spec["image"].endswith("-cuda"):
                assert f"-t {spec['image']} ." in (DOCKER / "services-cuda.Dockerfile").read_text()
        sandbox_image = spec.get("sandbox", {}).get("image")
        if sandbox_image:
            assert f"-t {sandbox_image} " in sandbox_base, path.name
