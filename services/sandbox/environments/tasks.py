"""Loading TaskSets: JSONL files of task records, validated with the environments' models.

Each line is one JSON object whose `type` names its environment. A line that is not JSON, has
an unknown type, or misses or mangles a field is rejected with the file, line, task id and
field named (`TaskSetError`, a ValueError: fix the file, retrying will not help).

Not covered: task synthesis (`kiln synth`), sampling and difficulty filters.
"""
from __future__ import annotations

import json
from pathlib import Path

from pydantic import ValidationError

from .base import Environment, TaskBase
from .code import CodeEnvironment
from .search import SearchEnvironment
from .swe import SweEnvironment
from .terminal import TerminalEnvironment

ENVIRONMENTS: dict[str, type[Environment]] = {
    "terminal": TerminalEnvironment, "swe": SweEnvironment, "search": SearchEnvironment,
    "code": CodeEnvironment,
}


class TaskSetError(ValueError):
    pass


def make_environment(kind: str, base_dir: Path | None = None) -> Environment:
    try:
        cls = ENVIRONMENTS[kind]
    except KeyError:
        raise ValueError(f"type: unknown environment {kind!r} "
                         f"({' | '.join(ENVIRONMENTS)})") from None
    return cls(base_dir)


def parse_task(record: dict, where: str = "task") -> TaskBase:
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


def load_taskset(path: Path) -> list[TaskBase]:
    tasks: list[TaskBase] = []
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
