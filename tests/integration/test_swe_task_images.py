"""SWE tasks run in their own image (the SWE-bench convention: one image per instance, the
repository inside it at `repo_path`), on the docker backend through podman's Docker API: a
tiny image is built here from a Containerfile (the host image the sandbox tests use, plus the
example repository at /testbed; no network). The reference fix passes, doing nothing fails, an
edited test is caught, and an image whose repository the sandbox user could write (so that the
agent could change what grading reads as the original) is refused at set-up.

The bubblewrap backend's refusal of such a task is in tests/unit/test_sandbox_units.py (fast).
"""
from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest

from kiln.services.sandbox.config import DockerConfig
from kiln.services.sandbox.environments.tasks import make_environment
from kiln.services.sandbox.factory import config_for, leftovers, make_sandbox
from kiln.services.sandbox.runner import run_solution

EXAMPLES = Path(__file__).resolve().parents[2] / "deploy" / "examples" / "tasks"
TAG = "localhost/kiln-swe-task-test:latest"


def _record() -> dict:
    record = json.loads((EXAMPLES / "swe.jsonl").read_text().splitlines()[0])
    del record["repo"]
    return {**record, "id": "calc-in-image", "image": TAG}


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory):
    if not (shutil.which("podman") and shutil.which("runc")):
        pytest.skip("podman and runc are not installed (deploy/setup.sh installs them)")
    from kiln.services.sandbox.podman_service import (DEFAULT_IMAGE, DEFAULT_ROOT, PodmanService,
                                                      build_host_image, podman_base_args)
    ctx = tmp_path_factory.mktemp("image")
    commit = _record()["commit"]
    subprocess.run(["git", "clone", "-q", str(EXAMPLES / "repos" / "calc.bundle"),
                    str(ctx / "testbed")], check=True)
    subprocess.run(["git", "-C", str(ctx / "testbed"), "-c", "advice.detachedHead=false",
                    "checkout", "-q", commit], check=True)
    # The same repository, writable by everyone: what an image must not do.
    shutil.copytree(ctx / "testbed", ctx / "writable", symlinks=True)
    subprocess.run(["chmod", "-R", "go-w", str(ctx / "testbed")], check=True)
    subprocess.run(["chmod", "-R", "a+w", str(ctx / "writable")], check=True)
    (ctx / "Containerfile").write_text(f"FROM {DEFAULT_IMAGE}\nCOPY testbed /testbed\n"
                                       "COPY writable /writable\n")
    with PodmanService() as service:
        build_host_image()
        subprocess.run([*podman_base_args(DEFAULT_ROOT), "build", "--pull=never", "-q",
                        "-t", TAG, "-f", str(ctx / "Containerfile"), str(ctx)],
                       check=True, capture_output=True)
        cfg = DockerConfig(owner=f"i{uuid.uuid4().hex[:8]}", base_url=service.base_url)
        yield cfg
        assert leftovers(cfg) == []


@pytest.mark.slow
def test_a_task_runs_in_its_image_and_is_graded_against_the_images_repository(engine) -> None:
    (task,) = make_environment("swe", EXAMPLES).load_tasks([_record()])
    fix = (EXAMPLES / "solutions" / "calc-divide-by-zero.patch").read_bytes()
    assert asyncio.run(run_solution(engine, task, EXAMPLES, fix)).reward == 1.0
    assert asyncio.run(run_solution(engine, task, EXAMPLES, None)).reward == 0.0
    # An edited test is caught, and the image's repository stays out of the agent's reach.
    exploit = asyncio.run(_attempt(
        engine, task, "sed -i 's/assertIsNone(divide(1, 0))/assertTrue(True)/' tests/test_ops.py "
        "&& ! (echo x >> /testbed/tests/test_ops.py) 2>/dev/null"))
    assert exploit.reward == 0.0 and "tests_modified" in exploit.flags


@pytest.mark.slow
def test_an_image_whose_repository_the_sandbox_user_can_write_is_refused(engine) -> None:
    (task,) = make_environment("swe", EXAMPLES).load_tasks([{**_record(), "repo_path": "/writable"}])
    with pytest.raises(RuntimeError, match="/writable in image .* is writable by the sandbox user"):
        asyncio.run(run_solution(engine, task, EXAMPLES, None))


async def _attempt(config: DockerConfig, task, shell: str):
    env = make_environment("swe", EXAMPLES)
    async with make_sandbox(config_for(config, task.image)) as sb:
        await env.setup(sb, task)
        res = await sb.exec(shell)
        assert res.exit_code == 0, res.stderr
        return await env.grade(sb, task)
