"""A task that names its own image (`image`, the SWE-bench convention): a SWE task then gives its
repository one way (the image's `repo_path`, or `repo` on the host), and the bubblewrap backend,
which cannot run an image, refuses it when the sandbox service starts, naming the task. The
docker backend running such a task is tests/integration/test_swe_task_images.py (slow)."""
from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path

import pytest

from kiln.api.spec import RLJob
from kiln.services.sandbox.config import BubblewrapConfig, DockerConfig
from kiln.services.sandbox.environments.tasks import make_environment
from kiln.services.sandbox.episodes import EpisodeError, EpisodeManager
from kiln.services.sandbox.factory import config_for
from kiln.services.sandbox.runner import run_solution

EXAMPLES = Path(__file__).resolve().parents[2] / "deploy" / "examples" / "tasks"
IMAGE = "registry.example.com/swe/calc-1:latest"


def _record(**changes) -> dict:
    record = json.loads((EXAMPLES / "swe.jsonl").read_text().splitlines()[0])
    return {**record, **changes}


def _load(record: dict):
    return make_environment("swe", EXAMPLES).load_tasks([record])[0]


@pytest.mark.parametrize("changes, message", [
    ({"image": IMAGE}, "repo and image: give the repository one way"),
    ({"repo": ""}, "repo: required"),
    ({"repo": "", "image": IMAGE, "repo_path": "testbed"}, "repo_path: 'testbed' must be an absolute"),
    ({"repo": "", "image": IMAGE, "repo_path": "/testbed/../etc"}, "without '..'"),
], ids=["both", "neither", "relative", "dotdot"])
def test_a_swe_task_gives_its_repository_one_way(changes: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _load(_record(**changes))


def test_a_task_in_its_own_image_runs_on_docker_in_that_image() -> None:
    task = _load(_record(repo="", image=IMAGE))
    assert task.repo_path == "/testbed"
    docker = DockerConfig(owner="t")
    assert config_for(docker, task.image).image == IMAGE
    assert config_for(docker, None) is docker


def test_bubblewrap_refuses_a_task_with_an_image_by_name(tmp_path: Path) -> None:
    (tmp_path / "swe.jsonl").write_text(json.dumps(_record(repo="", image=IMAGE)) + "\n")
    job = RLJob.model_validate({
        "apiVersion": "kiln.dev/v1alpha1", "kind": "RLJob", "metadata": {"name": "img"},
        "spec": {"model": {"path": "m"},
                 "tasks": [{"name": "swe-set", "env": "swe", "path": str(tmp_path / "swe.jsonl")}],
                 "stages": [{"name": "sft", "type": "sft", "tasks": ["swe-set"]}]}})
    config = BubblewrapConfig(owner=f"i{uuid.uuid4().hex[:8]}")
    with pytest.raises(EpisodeError, match=r"task set 'swe-set', task 'calc-divide-by-zero': names "
                       r"image 'registry.example.com/swe/calc-1:latest', which only the docker "
                       r"backend runs \(spec.sandbox.backend: docker\)"):
        EpisodeManager(job, base_dir=tmp_path, config=config)
    # `kiln sandbox verify` refuses it the same way, before any sandbox starts.
    with pytest.raises(ValueError, match="task calc-divide-by-zero: names image"):
        asyncio.run(run_solution(config, _load(_record(repo="", image=IMAGE)), EXAMPLES, None))
