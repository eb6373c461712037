"""How a Python project at one snapshot runs its tests, and whether a sandbox can run them.

Detection reads the snapshot's own files (through `read(path)`, so no checkout is needed):
`pyproject.toml` ([project] requires-python and dependencies), `setup.cfg` ([options]
python_requires and install_requires), `setup.py` (a literal install_requires list) and a
top-level `requirements.txt`. A `src/` layout puts `src` on PYTHONPATH. Tests always run through
pytest, which also runs unittest classes, so every test id is one `python -m pytest` accepts.

The environment is the sandbox's Python with the snapshot importable from its checkout (what an
editable install amounts to for a pure-Python project) and the project's declared runtime
dependencies already present: sandboxes are offline, so nothing is installed from an index. The
probe, run once in a sandbox, checks the Python version against requires-python and each
dependency with `importlib.metadata`; its result is cached under a key of what it depends on
(the Python requirement and the dependency list), so consecutive commits that leave them alone
share one probe. Without the cache every snapshot is probed.

Not covered: compiled extensions (a project with C sources is built by nobody here), installing
missing dependencies, and tox/nox environments beyond reading which runner they call.
"""
from __future__ import annotations

import ast
import configparser
import hashlib
import json
import re
import tomllib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")

PROBE = r'''
import importlib.metadata as md, json, sys
missing = []
for name in sys.argv[1:]:
    try:
        md.version(name)
    except md.PackageNotFoundError:
        missing.append(name)
try:
    import pytest
    pytest_version = pytest.__version__
except ImportError:
    pytest_version = None
print(json.dumps({"python": "%d.%d.%d" % sys.version_info[:3], "missing": missing,
                  "pytest": pytest_version}))
'''


@dataclass
class PythonProject:
    pythonpath: list[str] = field(default_factory=list)
    requires_python: str = ""
    dependencies: list[str] = field(default_factory=list)
    """Runtime requirement names (markers that do not apply to the sandbox's Python dropped)."""
    sources: list[str] = field(default_factory=list)
    """The files the above was read from."""

    def key(self) -> str:
        blob = json.dumps([self.requires_python, sorted(self.dependencies)])
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def spec(self) -> dict:
        return {"runner": "pytest", **asdict(self)}


def _requirement_names(lines: list[str], python: str) -> list[str]:
    names = []
    for line in lines:
        line = line.split("#", 1)[0].strip()
        if not line or line.startswith("-"):  # options, -r includes, -e editables
            continue
        requirement, _, marker = line.partition(";")
        if marker.strip() and not _marker_applies(marker.strip(), python):
            continue
        m = _NAME.match(requirement)
        if m:
            names.append(m.group(1))
    return names


def _marker_applies(marker: str, python: str) -> bool:
    try:
        from packaging.markers import Marker
    except ImportError:  # without packaging a marker is assumed to apply
        return True
    try:
        return Marker(marker).evaluate({"python_version": ".".join(python.split(".")[:2]),
                                        "python_full_version": python})
    except Exception:  # an unparsable marker: keep the requirement, the probe decides
        return True


def detect(read: Callable[[str], str | None], paths: list[str],
           python: str = "3.11.2") -> PythonProject:
    """`read(path)` gives a file of the snapshot (None if absent); `paths` lists its files."""
    project = PythonProject()
    if any(p.startswith("src/") and p.endswith("/__init__.py") for p in paths):
        project.pythonpath = ["src"]
    deps: list[str] = []
    text = read("pyproject.toml")
    if text is not None:
        project.sources.append("pyproject.toml")
        try:
            data = tomllib.loads(text).get("project", {})
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"pyproject.toml: not valid TOML ({exc})") from None
        project.requires_python = str(data.get("requires-python", ""))
        deps += _requirement_names([str(d) for d in data.get("dependencies", [])], python)
    text = read("setup.cfg")
    if text is not None:
        cfg = configparser.ConfigParser(interpolation=None)
        try:
            cfg.read_string(text)
        except configparser.Error as exc:
            raise ValueError(f"setup.cfg: cannot be parsed ({exc})") from None
        if cfg.has_section("options"):
            project.sources.append("setup.cfg")
            project.requires_python = (project.requires_python
                                       or cfg.get("options", "python_requires", fallback=""))
            deps += _requirement_names(
                cfg.get("options", "install_requires", fallback="").splitlines(), python)
    text = read("setup.py")
    if text is not None:
        project.sources.append("setup.py")
        deps += _requirement_names(_setup_py_requires(text), python)
    text = read("requirements.txt")
    if text is not None:
        project.sources.append("requirements.txt")
        deps += _requirement_names(text.splitlines(), python)
    project.dependencies = sorted(set(deps))
    return project


def _setup_py_requires(text: str) -> list[str]:
    """A literal `install_requires=[...]` in a setup() call; anything computed is not read."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return []
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg == "install_requires":
            try:
                value = ast.literal_eval(node.value)
            except ValueError:
                return []
            return [str(v) for v in value] if isinstance(value, (list, tuple)) else []
    return []


def sandbox_python() -> str:
    """The version of the Python sandboxes run (both backends use the host's /usr), for
    evaluating requirement markers before any sandbox is up."""
    import subprocess
    res = subprocess.run(["/usr/bin/python3", "-I", "-c",
                          "import platform; print(platform.python_version())"],
                         capture_output=True, text=True)
    return res.stdout.strip() or "3"


def python_ok(requires_python: str, python: str) -> bool:
    if not requires_python.strip():
        return True
    try:
        from packaging.specifiers import SpecifierSet
        return SpecifierSet(requires_python).contains(python, prereleases=True)
    except Exception:  # noqa: BLE001  an unparsable specifier: let the test run decide
        return True


class EnvCache:
    """Probe results by `PythonProject.key()`, on disk so a re-run reuses them; `enabled=False`
    forgets every result (each snapshot is probed again)."""

    def __init__(self, folder: Path, enabled: bool = True):
        self.folder = Path(folder)
        self.enabled = enabled
        self.hits = 0
        self.misses = 0

    def get(self, key: str) -> dict | None:
        path = self.folder / f"{key}.json"
        if self.enabled and path.is_file():
            self.hits += 1
            return json.loads(path.read_text())
        self.misses += 1
        return None

    def put(self, key: str, value: dict) -> None:
        if self.enabled:
            self.folder.mkdir(parents=True, exist_ok=True)
            (self.folder / f"{key}.json").write_text(json.dumps(value))


def verdict(project: PythonProject, probe: dict) -> str | None:
    """None when the sandbox can run the project's tests, else why not."""
    if probe.get("pytest") is None:
        return "environment: the sandbox's python has no pytest"
    if not python_ok(project.requires_python, probe["python"]):
        return (f"environment: requires-python {project.requires_python!r} excludes the "
                f"sandbox's python {probe['python']}")
    if probe.get("missing"):
        return "environment: dependencies missing offline: " + ", ".join(probe["missing"])
    return None
