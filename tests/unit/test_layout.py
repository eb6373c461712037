"""Packaging and architecture rules, enforced rather than reviewed.

- One import root on disk: every package lives under `src/kiln/`, found by setuptools'
  `packages.find` (no hand-kept package map, no .pth); nothing at the repository root can
  shadow a standard-library module (the operator is `kiln.operator`, never a bare `operator`),
  and `tests/` is not a package (shared helpers are `tests/helpers/`).
- Every source folder is a regular package.
- Four floors, bottom up: the ground (`kiln` core, `kiln.protos`, `kiln.kernels`, the model
  package `kiln.models`, and the control floor `kiln.control`: the control records, their
  converters, one client per control-plane service, the channel options and the one
  transient-error convention, the stage driver); `kiln.services.common` (the service
  bootstrap) and `kiln.operator`;
  the five services; the CLI (`kiln.cli`). No module imports from a floor above its own; on the
  ground floor the core imports no other package, protos and kernels only the core, the control
  floor only the core and protos, and the models only the kernels; a service uses another only through its `client` module (never a
  servicer or internals); the core, the bootstrap and the operator never import torch, vllm,
  megatron, triton or transformers.
- No Python file outside generated code has more than 400 lines.
"""
from __future__ import annotations

import ast
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SRC = REPO / "src"
SERVICES = ("rollout", "trainer", "sandbox", "weight_sync", "buffer")
HEAVY = ("torch", "vllm", "megatron", "triton", "transformers")
STDLIB_OPERATOR = Path(os.__file__).parent / "operator.py"


def test_stdlib_operator_under_pytest():
    import operator

    assert Path(operator.__file__) == STDLIB_OPERATOR
    assert hasattr(operator, "itemgetter")


@pytest.mark.parametrize("argv", [
    ["-c", "import operator; operator.itemgetter; print(operator.__file__)"],
    ["-m", "kiln.cli.main", "--help"],
    ["-c", "import collections, operator, kiln.operator; print(operator.__file__)"],
])
def test_stdlib_operator_from_repo_root(argv):
    res = subprocess.run([sys.executable, *argv], cwd=REPO, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    if "print" in argv[-1]:
        assert res.stdout.strip() == str(STDLIB_OPERATOR)


def test_sources_live_under_src_and_are_found_not_listed():
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "package-dir" not in setuptools and "packages" in setuptools
    assert setuptools["packages"] == {"find": {"where": ["src"], "include": ["kiln*"]}}
    assert sorted(p.name for p in SRC.iterdir() if p.name != "__pycache__"
                  and not p.name.endswith(".egg-info")) == ["kiln"]
    import kiln.operator

    assert Path(kiln.operator.__file__).parent == SRC / "kiln" / "operator"


def test_nothing_at_the_repository_root_shadows_a_module():
    # Whatever runs from the root (python -c, python -m, pytest) has the root on sys.path.
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True,
                             check=True).stdout.split()
    top = {Path(f).parts[0].removesuffix(".py") for f in tracked}
    assert not top & (set(sys.stdlib_module_names) | {"kiln"}), top & set(sys.stdlib_module_names)
    setup = (REPO / "deploy" / "setup.sh").read_text()
    assert not [line for line in setup.splitlines() if ".pth" in line and ">" in line], \
        "deploy/setup.sh writes a .pth"


def test_tests_are_not_a_package():
    inits = sorted(str(p.relative_to(REPO)) for p in (REPO / "tests").rglob("__init__.py"))
    assert inits == ["tests/helpers/__init__.py"]
    # No test module imports another test module: what they share lives in tests/helpers/.
    for path in (REPO / "tests").rglob("test_*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                assert not node.level and not (node.module or "").startswith("tests"), \
                    f"{path.relative_to(REPO)} imports {node.module} (put shared code in tests/helpers/)"


def _package_dirs():
    out = {}
    for dirpath, dirnames, filenames in os.walk(SRC / "kiln"):
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        if any(f.endswith(".py") for f in filenames):
            out[Path(dirpath)] = ".".join(Path(dirpath).relative_to(SRC).parts)
    return out


def test_every_source_folder_is_a_regular_package():
    for path in _package_dirs():
        assert (path / "__init__.py").exists(), f"{path} has modules but no __init__.py"


def _layer(module: str) -> tuple[int, str]:
    """(floor, group) of a kiln module: 1 the ground, 2 bootstrap and operator, 3 the services,
    4 the CLI."""
    parts = module.split(".")
    if parts[:2] in (["kiln", "protos"], ["kiln", "kernels"], ["kiln", "models"], ["kiln", "control"]):
        return 1, parts[1]
    if parts[:3] == ["kiln", "services", "common"]:
        return 2, "common"
    if parts[:2] == ["kiln", "operator"]:
        return 2, "operator"
    if parts[:2] == ["kiln", "services"] and len(parts) > 2 and parts[2] in SERVICES:
        return 3, parts[2]
    if parts[:2] == ["kiln", "services"]:
        return 3, "services"
    if parts[:2] == ["kiln", "cli"]:
        return 4, "cli"
    return 1, "core"


# What each ground-floor package may import of the others.
GROUND = {"core": {"core"}, "protos": {"core", "protos"}, "kernels": {"core", "kernels"},
          "models": {"core", "kernels", "models"}, "control": {"core", "protos", "control"}}
TORCH_FREE = ("core", "protos", "control", "common", "operator")


def _modules():
    for path, pkg in _package_dirs().items():
        for f in sorted(path.glob("*.py")):
            name = pkg if f.name == "__init__.py" else f"{pkg}.{f.stem}"
            yield name, f


def _imports(name: str, path: Path):
    tree = ast.parse(path.read_text(), filename=str(path))
    is_pkg = path.name == "__init__.py"
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")
                base = base if is_pkg else base[:-1]
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            yield mod


def test_no_import_goes_up_a_floor_or_across_services():
    problems = []
    for name, path in _modules():
        level, group = _layer(name)
        for imported in _imports(name, path):
            if not imported.startswith("kiln"):
                if imported.split(".")[0] in HEAVY and group in TORCH_FREE:
                    problems.append(f"{name} imports {imported} (a torch-free package)")
                continue
            ilevel, igroup = _layer(imported)
            if ilevel > level:
                problems.append(f"{name} (floor {level}, {group}) imports {imported} "
                                f"(floor {ilevel}, {igroup})")
            if level == ilevel == 1 and igroup not in GROUND[group]:
                problems.append(f"{name} ({group}) imports {imported} ({igroup}) on the ground floor")
            if level == ilevel == 2 and igroup != group:
                problems.append(f"{name} ({group}) imports {imported} ({igroup})")
            # A service may use another's published client (its contract's Python face),
            # never its servicer or internals.
            if level == 3 and ilevel == 3 and igroup != group and not imported.endswith(f"{igroup}.client"):
                problems.append(f"{name} imports another service's internals: {imported}")
    assert problems == []


def test_floors_are_what_the_design_says():
    # Every module falls on a floor, and the floors hold the packages they should.
    groups = {_layer(name) for name, _ in _modules()}
    assert {g for level, g in groups if level == 1} == {"core", "protos", "kernels", "models", "control"}
    assert {g for level, g in groups if level == 2} == {"common", "operator"}
    assert {g for level, g in groups if level == 3} == set(SERVICES) | {"services"}
    assert {g for level, g in groups if level == 4} == {"cli"}


def test_core_bootstrap_and_operator_import_no_heavy_package_at_runtime():
    light = [name for name, _ in _modules() if _layer(name)[1] in TORCH_FREE]
    code = (
        "import sys, importlib\n"
        f"for name in {light!r}:\n"
        "    importlib.import_module(name)\n"
        f"heavy = sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r})\n"
        "print(','.join(heavy))\n"
    )
    res = subprocess.run([sys.executable, "-c", code], cwd="/", capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert len(light) > 50 and res.stdout.strip() == ""


# The generated stubs of the control-plane services, which only a client may build.
CONTROL_STUBS = ("TrainerStub", "RolloutStub", "BufferStub", "WeightSyncStub")


def _names(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return ({n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
            | {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
            | {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names})


def test_one_client_per_control_plane_service():
    # The driver's side of every service is kiln.control.clients; a service's own client adds
    # its data-plane calls. Nothing else (the operator, the CLI) builds a stub of its own.
    allowed = {"kiln.control.clients"} | {f"kiln.services.{s}.client" for s in SERVICES}
    builders = {name for name, path in _modules() if set(CONTROL_STUBS) & _names(path)}
    assert builders - allowed == set(), "build a stub only in a client module"
    assert "kiln.control.clients" in builders


def test_one_transient_error_convention():
    # Which gRPC codes mean "ask again" is said once, in kiln.control.retry; other modules add
    # their own codes to that set (a full buffer, a stage not finished), never restate it.
    restating = [name for name, path in _modules() if name != "kiln.control.retry"
                 and not path.name.endswith("_pb2_grpc.py")
                 and {"UNAVAILABLE", "DEADLINE_EXCEEDED"} <= _names(path)]
    assert restating == []


def test_license_file_matches_pyproject():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["license"] == {"text": "Apache-2.0"}
    text = (REPO / "LICENSE").read_text()
    assert text.startswith("Apache License\nVersion 2.0, January 2004")
    assert "END OF TERMS AND CONDITIONS" in text


def _tracked_python_files() -> list[str]:
    return subprocess.run(["git", "ls-files", "*.py"], cwd=REPO, capture_output=True, text=True,
                          check=True).stdout.split()


def test_no_python_file_is_over_400_lines():
    # Sources, tests and benchmarks alike: a file near the cap splits where its concept splits.
    long = [f"{path}: {n}" for path in _tracked_python_files()
            if not path.endswith(("_pb2.py", "_pb2_grpc.py")) and (REPO / path).exists()
            and (n := len((REPO / path).read_text().splitlines())) > 400]
    assert long == []


def test_every_python_file_compiles():
    # Benchmarks and examples are not imported by the tests: a broken one would go unnoticed.
    bad = []
    for path in _tracked_python_files():
        if not (REPO / path).exists():  # deleted in the working tree
            continue
        try:
            ast.parse((REPO / path).read_text(), filename=path)
        except SyntaxError as exc:
            bad.append(f"{path}:{exc.lineno}: {exc.msg}")
    assert not bad, bad
