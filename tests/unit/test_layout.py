"""Packaging and architecture rules, enforced rather than reviewed.

- The standard library's `operator` is never shadowed by the repo's `operator/` folder (which is
  `kiln.operator`): not under pytest, not with `python -m`, not with `python -c`, from the root.
- Every source folder is a regular package, and pyproject lists every package.
- Layers: `kiln` core < protos/kernels < services.common and operator < the five services < the
  CLI/launcher. No module imports from a layer above its own, and a service uses another only
  through its `client` module; the core and the operator never import torch, vllm or megatron.
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
ROOTS = {"kiln": "kiln", "operator": "kiln.operator", "services": "kiln.services",
         "kernels": "kiln.kernels", "protos": "kiln.protos"}
SERVICES = ("rollout", "trainer", "sandbox", "weight_sync", "buffer")
HEAVY = ("torch", "vllm", "megatron", "triton", "transformers")
STDLIB_OPERATOR = Path(os.__file__).parent / "operator.py"


def test_stdlib_operator_under_pytest():
    import operator

    assert Path(operator.__file__) == STDLIB_OPERATOR
    assert hasattr(operator, "itemgetter")


@pytest.mark.parametrize("argv", [
    ["-c", "import operator; print(operator.__file__)"],
    ["-m", "kiln.services.cli", "--help"],
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
    parts = module.split(".")
    if parts[:2] == ["kiln", "protos"] or parts[:2] == ["kiln", "kernels"]:
        return 1, parts[1]
    if parts[:3] == ["kiln", "services", "common"]:
        return 2, "common"
    if parts[:2] == ["kiln", "operator"]:
        return 2, "operator"
    if parts[:2] == ["kiln", "services"] and len(parts) > 2 and parts[2] in SERVICES:
        return 3, parts[2]
    if parts[:2] == ["kiln", "services"]:
        return 4, "top"
    return 0, "core"


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


def test_no_import_goes_up_a_layer_or_across_services():
    problems = []
    for name, path in _modules():
        level, group = _layer(name)
        for imported in _imports(name, path):
            if not imported.startswith("kiln"):
                if imported.split(".")[0] in HEAVY and (level == 0 or group in ("operator", "protos")):
                    problems.append(f"{name} imports {imported} (torch-free layer)")
                continue
            ilevel, igroup = _layer(imported)
            if ilevel > level and level != 4:
                problems.append(f"{name} (layer {group}) imports {imported} (layer {igroup})")
            # A service may use another's published client (its contract's Python face),
            # never its internals.
            if level == 3 and ilevel == 3 and igroup != group and not imported.endswith(f"{igroup}.client"):
                problems.append(f"{name} imports another service's internals: {imported}")
            if group == "operator" and igroup in ("kernels", "common"):
                problems.append(f"{name} imports {imported}; the operator stays torch-free")
    assert problems == []


def test_core_and_operator_import_no_heavy_package_at_runtime():
    code = (
        "import sys, pkgutil, importlib, kiln, kiln.api, kiln.operator\n"
        "for pkg in (kiln, kiln.operator):\n"
        "    for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + '.'):\n"
        "        if not m.name.startswith(('kiln.services', 'kiln.kernels', 'kiln.protos')):\n"
        "            importlib.import_module(m.name)\n"
        f"heavy = sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r} or m.startswith('kiln.services'))\n"
        "print(','.join(heavy))\n"
    )
    res = subprocess.run([sys.executable, "-c", code], cwd="/", capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == ""
