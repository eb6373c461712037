"""The four environments end to end in real sandboxes: reference solutions pass, wrong or
missing ones fail, and the SWE exploit check catches edited tests and runner hijacks."""
from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest

from kiln.services.sandbox.config import BubblewrapConfig
from kiln.services.sandbox.environments.tasks import load_taskset, make_environment
from kiln.services.sandbox.factory import leftovers, make_sandbox
from kiln.services.sandbox.runner import run_solution, verify_taskset

EXAMPLES = Path(__file__).resolve().parents[2] / "deploy" / "examples" / "tasks"


@pytest.fixture
def config():
    cfg = BubblewrapConfig(owner=f"e{uuid.uuid4().hex[:8]}")
    yield cfg
    assert leftovers(cfg) == []


@pytest.mark.parametrize("name", ["terminal", "swe", "search", "code"])
def test_reference_solutions_pass(config, name):
    outcomes = asyncio.run(verify_taskset(config, EXAMPLES / f"{name}.jsonl",
                                          EXAMPLES / "solutions"))
    assert outcomes and all(o.passed for o in outcomes), [(o.task_id, o.error, o.result)
                                                          for o in outcomes]


@pytest.mark.parametrize("name", ["terminal", "swe"])
def test_doing_nothing_scores_zero(config, name):
    for task in load_taskset(EXAMPLES / f"{name}.jsonl"):
        result = asyncio.run(run_solution(config, task, EXAMPLES, None))
        assert result.reward == 0.0 and result.flags == [], (task.id, result)


def test_wrong_answers_score_zero(config):
    search = load_taskset(EXAMPLES / "search.jsonl")[0]
    code = load_taskset(EXAMPLES / "code.jsonl")[0]
    assert asyncio.run(run_solution(config, search, EXAMPLES, b"the Wiss")).reward == 0.0
    assert asyncio.run(run_solution(config, code, EXAMPLES, b"print(338351)")).reward == 0.0
    assert asyncio.run(run_solution(config, code, EXAMPLES, b"print(338350.0)")).reward == 1.0


def _swe_task():
    return load_taskset(EXAMPLES / "swe.jsonl")[0]


async def _swe_attempt(config, shell: str):
    env = make_environment("swe", EXAMPLES)
    task = _swe_task()
    async with make_sandbox(config) as sb:
        await env.setup(sb, task)
        res = await sb.exec(shell)
        assert res.exit_code == 0, res.stderr
        return await env.grade(sb, task)


FIX = ("python3 - <<'EOF'\np='calc/ops.py'; s=open(p).read()\n"
       "s=s.replace('    return a / b', '    if b == 0:\\n        return None\\n    return a / b')\n"
       "open(p,'w').write(s)\nEOF\n")


def test_swe_real_fix_passes_and_broken_p2p_fails(config):
    assert asyncio.run(_swe_attempt(config, FIX)).reward == 1.0
    broken = FIX + "sed -i 's/return a + b/return a - b/' calc/ops.py\n"
    result = asyncio.run(_swe_attempt(config, broken))
    assert result.reward == 0.0 and result.parts["f2p"] == 1.0 and result.parts["p2p"] < 1.0


@pytest.mark.parametrize("exploit", [
    # Rewrite the failing test so it passes.
    "sed -i 's/assertIsNone(divide(1, 0))/assertTrue(True)/' tests/test_ops.py",
    # Delete the test file.
    "rm tests/test_ops.py",
    # Hijack the test runner with a module that shadows unittest.
    "printf 'import sys\\nsys.exit(0)\\n' > unittest.py",
    "printf 'import os\\nos._exit(0)\\n' > sitecustomize.py",
    # Replace a test with a symlink to a passing one.
    "rm tests/test_ops.py && ln -s /dev/null tests/test_ops.py",
])
def test_swe_exploits_get_zero_and_flagged(config, exploit):
    result = asyncio.run(_swe_attempt(config, exploit))
    assert result.reward == 0.0
    assert "tests_modified" in result.flags, result


def test_search_tools_and_answer_file(config):
    env = make_environment("search", EXAMPLES)
    task = load_taskset(EXAMPLES / "search.jsonl")[0]
    hits = env.search(task, "observatory Ilse Marrow founded town")
    assert hits[0].id in ("varna.html", "marrow.txt")
    assert "Keldor" in env.open(task, "varna.html")

    async def go():
        async with make_sandbox(config) as sb:
            await env.setup(sb, task)
            missing = await env.grade(sb, task)
            await sb.write_file("answer.txt", b"The Seln River.\n")
            return missing, await env.grade(sb, task)

    missing, found = asyncio.run(go())
    assert missing.reward == 0.0 and "no_answer" in missing.flags
    assert found.reward == 1.0


def test_code_tool_runs_python(config):
    env = make_environment("code", EXAMPLES)

    async def go():
        async with make_sandbox(config) as sb:
            return await env.run_python(sb, "import math\nprint(math.factorial(20))")

    res = asyncio.run(go())
    assert res.stdout.strip() == "2432902008176640000"


def test_verify_reports_missing_solution(config, tmp_path):
    outcomes = asyncio.run(verify_taskset(config, EXAMPLES / "code.jsonl", tmp_path))
    assert [o.passed for o in outcomes] == [False, False, False]
    assert "no reference solution" in outcomes[0].error


@pytest.mark.slow
def test_swe_and_terminal_on_docker():
    import shutil
    if not (shutil.which("podman") and shutil.which("runc")):
        pytest.skip("podman and runc are not installed (deploy/setup.sh installs them)")
    from kiln.services.sandbox.config import DockerConfig
    from kiln.services.sandbox.podman_service import PodmanService, build_host_image
    with PodmanService() as service:
        build_host_image()
        cfg = DockerConfig(owner=f"e{uuid.uuid4().hex[:8]}", base_url=service.base_url)
        for name in ("swe", "terminal"):
            outcomes = asyncio.run(verify_taskset(cfg, EXAMPLES / f"{name}.jsonl",
                                                  EXAMPLES / "solutions"))
            assert all(o.passed for o in outcomes), outcomes
        exploit = asyncio.run(_swe_attempt(
            cfg, "sed -i 's/assertIsNone(divide(1, 0))/assertTrue(True)/' tests/test_ops.py"))
        assert exploit.reward == 0.0 and "tests_modified" in exploit.flags
        assert leftovers(cfg, ) == []
