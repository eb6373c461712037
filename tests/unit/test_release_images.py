"""Images you can build and point to: the release workflow builds every Dockerfile under
deploy/docker, tagged with the chart's appVersion, into the registry its variable names; the
chart's `image.registry` is where the operator's image comes from, is allowed for jobs, and is
where a job that leaves `spec.image` at Kiln's default gets its services image.

The workflow cannot run here (no GitHub runner, no registry): it is parsed, checked against the
Dockerfiles' own headers, and its one shell step (reading the version and the registry) is run
with bash. actionlint cannot be installed offline (its Python package downloads the binary).
"""
from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from kiln.api.images import DEFAULT_REGISTRY, IMAGES, from_registry
from kiln.operator.config import OperatorConfig
from kiln.operator.reconcile import parse_spec

from helpers.operator_jobs import SMALL

ROOT = Path(__file__).resolve().parents[2]
WORKFLOW = ROOT / ".github" / "workflows" / "release.yaml"
DOCKER = ROOT / "deploy" / "docker"
APP_VERSION = yaml.safe_load((ROOT / "charts" / "kiln" / "Chart.yaml").read_text())["appVersion"]
HELM = ROOT / ".tools" / "bin" / "helm"


def _workflow() -> dict:
    return yaml.safe_load(WORKFLOW.read_text())


def test_the_workflow_builds_every_dockerfile_with_the_tag_its_header_names() -> None:
    matrix = _workflow()["jobs"]["images"]["strategy"]["matrix"]["include"]
    built = sorted(Path(m["dockerfile"]).name for m in matrix)
    assert built == sorted(p.name for p in DOCKER.glob("*.Dockerfile"))
    for m in matrix:
        header = (ROOT / m["dockerfile"]).read_text()
        # The Dockerfile's own build line: the same image name, tag and context.
        tag = f"{DEFAULT_REGISTRY}/{m['name']}:{APP_VERSION}{m['suffix']}"
        assert re.search(rf"-f {re.escape(m['dockerfile'])} -t {re.escape(tag)} {re.escape(m['context'])}\n",
                         header), (m, tag)
    assert {m["name"] for m in matrix} == set(IMAGES.values())


def test_the_workflow_pushes_to_the_registry_variable() -> None:
    wf = _workflow()
    assert set(wf[True]) == {"push", "workflow_dispatch"}  # YAML 1.1 reads `on` as true
    (build,) = [s for s in wf["jobs"]["images"]["steps"] if "build-push-action" in s.get("uses", "")]
    assert build["with"]["push"] is True
    assert build["with"]["tags"].startswith("${{ needs.version.outputs.registry }}/${{ matrix.name }}:"
                                            "${{ needs.version.outputs.app_version }}")
    (login,) = [s for s in wf["jobs"]["images"]["steps"] if "login-action" in s.get("uses", "")]
    assert login["with"]["registry"] == "${{ needs.version.outputs.registry }}"
    step = wf["jobs"]["version"]["steps"][1]
    assert step["env"]["KILN_REGISTRY"] == "${{ vars.KILN_REGISTRY }}"


def _version_step(tmp_path: Path, **env: str) -> tuple[int, dict[str, str], str]:
    out = tmp_path / "github_output"
    out.write_text("")
    script = _workflow()["jobs"]["version"]["steps"][1]["run"]
    proc = subprocess.run(["bash", "-e", "-c", script], cwd=ROOT, capture_output=True, text=True,
                          env={"PATH": os.environ["PATH"], "GITHUB_OUTPUT": str(out), **env})
    values = dict(line.split("=", 1) for line in out.read_text().splitlines())
    return proc.returncode, values, proc.stderr


def test_the_version_step_reads_the_charts_app_version_and_the_registry(tmp_path: Path) -> None:
    code, values, _ = _version_step(tmp_path, GITHUB_REF_TYPE="tag", GITHUB_REF_NAME=f"v{APP_VERSION}",
                                    KILN_REGISTRY="Registry.Example.com/ML/", OWNER="kiln-dev")
    assert code == 0 and values == {"app_version": APP_VERSION, "registry": "registry.example.com/ml"}
    code, values, _ = _version_step(tmp_path, GITHUB_REF_TYPE="branch", GITHUB_REF_NAME="main",
                                    KILN_REGISTRY="", OWNER="Kiln-Dev")
    assert code == 0 and values["registry"] == "ghcr.io/kiln-dev"
    # A release tag that is not the chart's version pushes nothing.
    code, _, err = _version_step(tmp_path, GITHUB_REF_TYPE="tag", GITHUB_REF_NAME="v9.9.9",
                                 KILN_REGISTRY="", OWNER="kiln-dev")
    assert code != 0 and f"does not match the chart's appVersion {APP_VERSION}" in err


def test_a_job_left_at_the_default_image_runs_it_from_the_charts_registry() -> None:
    spec, problems = parse_spec("j", dict(SMALL), "registry.example.com/ml")
    assert not problems and spec.image == f"registry.example.com/ml/kiln:{APP_VERSION}"
    cuda, _ = parse_spec("j", {**SMALL, "image": f"{DEFAULT_REGISTRY}/kiln:{APP_VERSION}-cuda"},
                         "registry.example.com/ml")
    assert cuda.image == f"registry.example.com/ml/kiln:{APP_VERSION}-cuda"
    own, _ = parse_spec("j", {**SMALL, "image": "team.example.com/kiln-fork:1"}, "registry.example.com/ml")
    assert own.image == "team.example.com/kiln-fork:1"
    assert from_registry(spec, None) is spec


@pytest.mark.skipif(not HELM.exists(), reason=f"helm not installed at {HELM} (deploy/setup.sh)")
def test_the_charts_registry_reaches_the_operator_and_its_allowlist() -> None:
    proc = subprocess.run([str(HELM), "template", "kiln", str(ROOT / "charts" / "kiln"),
                           "--set", "image.registry=registry.example.com/ml",
                           "--set", "operator.allowed.imageRegistries={docker.io/library/}"],
                          capture_output=True, text=True, check=True, timeout=60)
    (deployment,) = [d for d in yaml.safe_load_all(proc.stdout) if d and d["kind"] == "Deployment"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["image"] == f"registry.example.com/ml/kiln-operator:{APP_VERSION}"
    config = OperatorConfig.from_env({e["name"]: e["value"] for e in container["env"]})
    assert config.image_registry == "registry.example.com/ml"
    assert config.allowed_image_registries == ["docker.io/library/", "registry.example.com/ml/"]
    spec, _ = parse_spec("j", dict(SMALL), config.image_registry)
    assert not config.allowlist.refusals(spec)  # its own default image is allowed
    bad = subprocess.run([str(HELM), "template", "kiln", str(ROOT / "charts" / "kiln"),
                          "--set", "image.registry=https://registry.example.com"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "image.registry" in bad.stderr
