"""The built-in environments by name, and task sets of typed records (`kiln sandbox verify`).

In a task set file for `kiln sandbox verify` each line is one JSON object whose `type` names its
built-in environment. A line that is not JSON, has an unknown type, or misses or mangles a field
is rejected with the file, line, task id and field named (`TaskSetError`, a ValueError: fix the
file, retrying will not help). The job's task sets name their environment in the job instead
(`episodes.load_task_set`).

Task sets are built by `kiln synth` (`src/kiln/cli/synth/`). Not covered: sampling and difficulty filters.
"""
from __future__ import annotations

import json
from pathlib import Path

from pydantic import ValidationError

from .base import Environment, Task
from .chain import ChainEnvironment
from .code import CodeEnvironment
from .lookup import LookupEnvironment
from .search import SearchEnvironment
from .swe import SweEnvironment
from .terminal import TerminalEnvironment
from .wide import WideEnvironment, WideLookupEnvironment

ENVIRONMENTS: dict[str, type[Environment]] = {
    "chain": ChainEnvironment, "lookup": LookupEnvironment, "terminal": TerminalEnvironment,
    "swe": SweEnvironment, "search": SearchEnvironment, "code": CodeEnvironment,
    "wide": WideEnvironment, "wide-lookup": WideLookupEnvironment,
}


class TaskSetError(ValueError):
    pass


def builtin_environment(kind: str) -> type[Environment]:
    try:
        return ENVIRONMENTS[kind]
    except KeyError:
        raise ValueError(f"type: unknown environment {kind!r} "
                         f"({' | '.join(ENVIRONMENTS)})") from None


def make_environment(kind: str, base_dir: Path | None = None) -> Environment:
    return builtin_environment(kind)(base_dir)


def parse_task(record: dict, where: str = "task") -> Task:
    task_id = record.get("id", "<no id>") if isinstance(record, dict) else "<not an object>"
    if not isinstance(record, dict):
        raise TaskSetError(f"{where}: expected a JSON object")
    kind = record.get("type")
    if kind not in ENVIRONMENTS:
        raise TaskSetError(f"{where}, task {task_id!r}: field 'type': unknown environment "
                           f"{kind!r} ({' | '.join(ENVIRONMENTS)})")
    try:
        return ENVIRONMENTS[kind].task_model.model_validate(record)
    except ValidationError as exc:
        problems = "; ".join(
            f"field {'.'.join(str(p) for p in err['loc']) or '<record>'!r}: {err['msg']}"
            for err in exc.errors())
        raise TaskSetError(f"{where}, task {task_id!r}: {problems}") from None


def load_taskset(path: Path) -> list[Task]:
    tasks: list[Task] = []
    seen: set[str] = set()
    for lineno, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TaskSetError(f"{where}: not valid JSON ({exc.msg})") from None
        task = parse_task(record, where)
        if task.id in seen:
            raise TaskSetError(f"{where}, task {task.id!r}: field 'id': duplicate id")
        seen.add(task.id)
        tasks.append(task)
    return tasks
