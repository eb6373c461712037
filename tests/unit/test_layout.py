"""Packaging and architecture rules, enforced rather than reviewed.

- The standard library's `operator` is never shadowed by the repo's `operator/` folder (which is
  `kiln.operator`): not under pytest, not with `python -m`, not with `python -c`, from the root.
- Every source folder is a regular package, and pyproject lists every package.
- Four floors, bottom up: the ground (`kiln` core, `kiln.protos`, `kiln.kernels`, the model
  package `kiln.models`); `kiln.services.common` (the service bootstrap) and `kiln.operator`;
  the five services; the CLI (`kiln.cli`). No module imports from a floor above its own; on the
  ground floor the core imports no other package, protos and kernels only the core, and the
  models only the kernels; a service uses another only through its `client` module (never a
  servicer or internals); the core, the bootstrap and the operator never import torch, vllm,
  megatron, triton or transformers.
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
ROOTS = {"kiln": "kiln", "protos": "kiln.protos", "kernels": "kiln.kernels", "models": "kiln.models",
         "operator": "kiln.operator", "services": "kiln.services", "cli": "kiln.cli"}
SERVICES = ("rollout", "trainer", "sandbox", "weight_sync", "buffer")
HEAVY = ("torch", "vllm", "megatron", "triton", "transformers")
STDLIB_OPERATOR = Path(os.__file__).parent / "operator.py"


def test_stdlib_operator_under_pytest():
    import operator

    assert Path(operator.__file__) == STDLIB_OPERATOR
    assert hasattr(operator, "itemgetter")


@pytest.mark.parametrize("argv", [
    ["-c", "import operator; print(operator.__file__)"],
    ["-m", "kiln.cli.main", "--help"],
    ["-c", "import collections, operator, kiln.operator; print(operator.__file__)"],
])
def test_stdlib_operator_from_repo_root(argv):
    res = subprocess.run([sys.executable, *argv], cwd=REPO, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    if "print" in argv[-1]:
        assert res.stdout.strip() == str(STDLIB_OPERATOR)


def test_kiln_operator_is_the_repo_folder():
    import kiln.operator

    assert Path(kiln.operator.__file__).parent == REPO / "operator"


def _package_dirs():
    out = {}
    for folder, pkg in ROOTS.items():
        for dirpath, dirnames, filenames in os.walk(REPO / folder):
            dirnames[:] = [d for d in dirnames if d != "__pycache__"]
            if any(f.endswith(".py") for f in filenames):
                rel = Path(dirpath).relative_to(REPO / folder)
                out[Path(dirpath)] = ".".join([pkg, *rel.parts]) if rel.parts else pkg
    return out


def test_every_source_folder_is_a_listed_regular_package():
    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    for path, pkg in _package_dirs().items():
        assert (path / "__init__.py").exists(), f"{path} has modules but no __init__.py"
        assert pkg in listed, f"{pkg} ({path}) is missing from pyproject's packages list"


def _layer(module: str) -> tuple[int, str]:
    """(floor, group) of a kiln module: 1 the ground, 2 bootstrap and operator, 3 the services,
    4 the CLI."""
    parts = module.split(".")
    if parts[:2] in (["kiln", "protos"], ["kiln", "kernels"], ["kiln", "models"]):
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
          "models": {"core", "kernels", "models"}}
TORCH_FREE = ("core", "protos", "common", "operator")


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
    assert {g for level, g in groups if level == 1} == {"core", "protos", "kernels", "models"}
    assert {g for level, g in groups if level == 2} == {"common", "operator"}
    assert {g for level, g in groups if level == 3} == set(SERVICES) | {"services"}
    assert {g for level, g in groups if level == 4} == {"cli"}


def test_core_bootstrap_and_operator_import_no_heavy_package_at_runtime():
    code = (
        "import sys, pkgutil, importlib, kiln, kiln.api, kiln.operator, kiln.services.common\n"
        "import kiln.protos.kiln.v1\n"
        "for pkg in (kiln, kiln.operator, kiln.services.common, kiln.protos.kiln.v1):\n"
        "    for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + '.'):\n"
        "        if not m.name.startswith(('kiln.services.', 'kiln.kernels', 'kiln.models', 'kiln.cli')) \\\n"
        "                or m.name.startswith('kiln.services.common'):\n"
        "            importlib.import_module(m.name)\n"
        f"heavy = sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r})\n"
        "print(','.join(heavy))\n"
    )
    res = subprocess.run([sys.executable, "-c", code], cwd="/", capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == ""


def test_license_file_matches_pyproject():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["license"] == {"text": "Apache-2.0"}
    text = (REPO / "LICENSE").read_text()
    assert text.startswith("Apache License\nVersion 2.0, January 2004")
    assert "END OF TERMS AND CONDITIONS" in text


def test_no_source_file_is_over_400_lines():
    long = [f"{path.relative_to(REPO)}: {n}" for _, path in _modules()
            if not path.name.endswith(("_pb2.py", "_pb2_grpc.py"))
            and (n := len(path.read_text().splitlines())) > 400]
    assert long == []


def test_every_python_file_compiles():
    # Benchmarks and examples are not imported by the tests: a broken one would go unnoticed.
    bad = []
    for path in subprocess.run(["git", "ls-files", "*.py"], cwd=REPO, capture_output=True, text=True,
                               check=True).stdout.split():
        try:
            ast.parse((REPO / path).read_text(), filename=path)
        except SyntaxError as exc:
            bad.append(f"{path}:{exc.lineno}: {exc.msg}")
    assert not bad, bad
