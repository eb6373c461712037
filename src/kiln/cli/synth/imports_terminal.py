"""Terminal-Bench task folders into Kiln terminal tasks (see `imports.py` for the translation
rules); verification happens there."""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import yaml

from .imports import safe_id

INSTALLERS = re.compile(r"^\s*(apt-get|apt|pip3?|python3? -m pip|uv\s+(pip|venv|sync|add|init|tool)|"
                        r"curl|wget|source\s+\$HOME/\.local)\b|\|\s*(sh|bash)\s*$")
TEXT_LIMIT = 1 << 20


def _app(text: str) -> str:
    return re.sub(r"(?<![\w/])/app\b", "/workspace", text)


def _description(meta: dict, folder: Path) -> str:
    if isinstance(meta.get("instruction"), str):
        return meta["instruction"]
    for d in meta.get("descriptions") or []:
        if isinstance(d, dict) and d.get("description") and d.get("key", "base") == "base":
            return str(d["description"])
    raise ValueError(f"{folder / 'task.yaml'}: no `instruction` (or base `descriptions` entry)")


def _dockerfile(folder: Path) -> tuple[dict[str, str], list[str]]:
    """(files copied in, set-up commands) from COPY and RUN lines; other lines are ignored."""
    path = folder / "Dockerfile"
    if not path.is_file():
        return {}, []
    text = path.read_text().replace("\\\n", " ")
    files: dict[str, str] = {}
    setup: list[str] = []
    for line in text.splitlines():
        parts = line.strip().split(None, 1)
        if len(parts) < 2:
            continue
        op, rest = parts[0].upper(), parts[1]
        if op == "RUN":
            setup.append(_app(rest))
        elif op == "COPY":
            args = [a for a in shlex.split(rest) if not a.startswith("--")]
            if len(args) < 2:
                continue
            *sources, dest = args
            dest = _app(dest).removeprefix("/workspace").lstrip("/")
            for src in sources:
                files.update(_copied(folder, src, dest, len(sources) > 1))
    return files, setup


def _copied(folder: Path, src: str, dest: str, many: bool) -> dict[str, str]:
    base = (folder / src).resolve()
    if not base.is_relative_to(folder.resolve()) or not base.exists():
        raise ValueError(f"{folder / 'Dockerfile'}: COPY {src}: no such file in the task folder")
    out = {}
    items = [base] if base.is_file() else sorted(p for p in base.rglob("*") if p.is_file())
    for item in items:
        if item.stat().st_size > TEXT_LIMIT:
            raise ValueError(f"{item}: larger than 1 MiB; only text files are imported")
        if base.is_file():
            target = f"{dest.rstrip('/')}/{item.name}" if (many or dest.endswith("/") or not dest) \
                else dest
        else:
            target = f"{dest.rstrip('/')}/{item.relative_to(base)}".lstrip("/")
        if target.lstrip("./") in ("", "."):
            target = item.name
        out[target.lstrip("/")] = item.read_text()
    return out


def _test_script(folder: Path) -> str:
    """Writes the task's tests/ into the verifier's folder, then runs run-tests.sh without its
    installer lines, with TEST_DIR pointing there."""
    run_tests = folder / "run-tests.sh"
    if not run_tests.is_file():
        raise ValueError(f"{run_tests}: missing (the task's test entry point)")
    lines = ["set -e", 'TEST_DIR="$PWD/.kiln-verifier/tests"; export TEST_DIR',
             'mkdir -p "$TEST_DIR"']
    tests = folder / "tests"
    for path in sorted(tests.rglob("*")) if tests.is_dir() else []:
        if path.is_file():
            rel = path.relative_to(tests)
            marker = "KILN_EOF_" + safe_id(str(rel)).replace("-", "_").replace(".", "_")
            lines += [f'mkdir -p "$TEST_DIR/{rel.parent}"',
                      f"cat > \"$TEST_DIR/{rel}\" <<'{marker}'", _app(path.read_text()).rstrip("\n"),
                      marker]
    lines.append("set +e")
    for line in _app(run_tests.read_text()).splitlines():
        if line.startswith("#!") or INSTALLERS.search(line):
            continue
        line = re.sub(r"^(\s*)(uv run\s+)?pytest\b", r"\1python3 -m pytest", line)
        lines.append(line)
    return "\n".join(lines) + "\n"


def convert_terminal_bench(args, out: Path, report) -> list[tuple[dict, str, bytes]]:
    root = Path(args.source)
    if not root.is_dir():
        raise ValueError(f"{root}: not a folder of task folders")
    folders = sorted(p for p in root.iterdir() if (p / "task.yaml").is_file())
    if not folders:
        raise ValueError(f"{root}: no task folder (a folder with task.yaml) inside")
    folders = folders[:args.max_tasks]
    report.count("records", len(folders))
    items = []
    for folder in folders:
        rid = safe_id(folder.name)
        try:
            meta = yaml.safe_load((folder / "task.yaml").read_text()) or {}
            if not isinstance(meta, dict):
                raise ValueError(f"{folder / 'task.yaml'}: expected a mapping")
            description = _description(meta, folder)
            files, setup = _dockerfile(folder)
            test_script = _test_script(folder)
            solution_path = folder / "solution.sh"
            if not solution_path.is_file():
                raise ValueError(f"{solution_path}: missing (the reference solution)")
            solution = _app(solution_path.read_text())
        except (ValueError, OSError, yaml.YAMLError, UnicodeDecodeError) as exc:
            report.reject(rid, "well-formed", str(exc)[:500])
            continue
        report.count("well-formed")
        timeout = float(meta.get("max_test_timeout_sec") or args.timeout)
        record = {"id": rid, "type": "terminal", "description": description,
                  "setup": ("set -e\n" + "\n".join(setup)) if setup else "",
                  "files": files, "test_script": test_script,
                  "solution_commands": [solution], "timeout_seconds": timeout}
        items.append((record, f"{rid}.sh", solution.encode()))
    return items
