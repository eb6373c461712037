"""Task sets: a job's `spec.tasks` entry loaded, its environment made and its tasks read.

A task set is generated (`generate`, built-in environments) or read from a JSONL file (`path`,
or a cluster's `source` mounted under `tasks_root`; relative paths inside resolve against its
folder). Its environment is built in or a user's plugin (`env: {plugin: "module:Class"}`), with
an optional reward plugin. The sandbox service runs plugins in a confined worker
(`plugins.py`, `confine_plugins=True`); the CLI imports them in the user's own process.

Not covered: playing episodes (`episodes.py`).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from kiln.api.rewards import RewardRules
from kiln.api.spec import TaskSetSpec
from kiln.api.task_sources import located
from kiln.env import Environment, PluginError, Task, load_plugin

from .environments.tasks import builtin_environment
from .latency import LatencyDraws
from .plugin_codec import PluginFailure
from .plugins import PluginWorker, load_plugins


class EpisodeError(ValueError):
    """The request names something that does not exist or is not supported; do not retry."""


@dataclass
class TaskSet:
    name: str
    env_name: str
    environment: Environment
    tasks: list[Task]
    reward_fn: Callable[..., Any] | None = None
    latency: LatencyDraws | None = None
    """Extra time per tool call (`toolLatency`), slept in the episode's sandbox."""
    rules: RewardRules | None = None
    """Rule-based components added to the grade (`rewardRules`)."""
    worker: PluginWorker | None = None
    """The process the task set's plugins run in, when they run confined."""


def load_task_set(spec: TaskSetSpec, base_dir: Path, tasks_root: str | None = None, *,
                  confine_plugins: bool = False, plugin_memory: int | None = None) -> TaskSet:
    """The task set a job's `spec.tasks` entry names, its environment made. EpisodeError
    (naming the entry) for anything that cannot load. `tasks_root`: where a cluster's task
    sources are mounted (`kiln.api.task_sources`). `confine_plugins`: run the task set's
    plugins in a confined worker (`plugins.py`), as the service must; without it they are
    imported here (the CLI does, in the user's own process); `plugin_memory` bounds that
    worker's address space (bytes)."""
    where = f"spec.tasks[{spec.name}]"
    try:
        spec = located(spec, tasks_root)
    except ValueError as exc:
        raise EpisodeError(str(exc)) from None
    if confine_plugins and (not isinstance(spec.env, str) or spec.reward):
        return _load_confined(spec, base_dir, where, plugin_memory)
    try:
        if isinstance(spec.env, str):
            env_cls = builtin_environment(spec.env)
        else:
            env_cls = load_plugin(spec.env.plugin, "environment")
        reward_fn = load_plugin(spec.reward.plugin, "reward") if spec.reward else None
    except PluginError as exc:
        raise EpisodeError(f"{where}: {exc}") from None
    env, tasks = _make_tasks(spec, env_cls, base_dir, where)
    latency = LatencyDraws(spec.tool_latency) if spec.tool_latency else None
    return TaskSet(spec.name, spec.env_name, env, tasks, reward_fn, latency, spec.reward_rules)


def _read_records(spec: TaskSetSpec, base_dir: Path, where: str) -> tuple[Path, list[dict]]:
    path = Path(spec.path)
    path = path if path.is_absolute() else base_dir / path
    try:
        return path, [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (OSError, ValueError) as exc:
        raise EpisodeError(f"{where}.path: {path}: {exc}") from None


def _load_confined(spec: TaskSetSpec, base_dir: Path, where: str,
                   memory_bytes: int | None) -> TaskSet:
    """A task set whose environment or reward is a plugin, the plugin run in its worker."""
    plugin_env = not isinstance(spec.env, str)
    env_dir, records = base_dir, None
    if plugin_env:  # a plugin's tasks come from a file (`generate` is for built-ins)
        path, records = _read_records(spec, base_dir, where)
        env_dir = path.parent
    try:
        env, tasks, reward_fn, worker = load_plugins(
            spec.name, spec.env.plugin if plugin_env else None,
            None if plugin_env else spec.env, spec.reward.plugin if spec.reward else None,
            env_dir, records, [base_dir], memory_bytes)
    except (ValueError, PluginFailure) as exc:
        raise EpisodeError(f"{where}: {exc}") from None
    if env is None:
        try:
            env, tasks = _make_tasks(spec, builtin_environment(spec.env), base_dir, where)
        except BaseException:
            worker.close()
            raise
    elif not tasks:
        worker.close()
        raise EpisodeError(f"{where}: no tasks")
    latency = LatencyDraws(spec.tool_latency) if spec.tool_latency else None
    return TaskSet(spec.name, spec.env_name, env, tasks, reward_fn, latency, spec.reward_rules,
                   worker)


def _make_tasks(spec: TaskSetSpec, env_cls, base_dir: Path, where: str
                ) -> tuple[Environment, list[Task]]:
    if spec.generate is not None:
        env = env_cls(base_dir)
        try:
            tasks = env.generate_tasks(spec.generate)
        except ValueError as exc:
            # A setting the environment cannot hold; retrying will not help.
            raise EpisodeError(f"{where}.generate: {exc}") from exc
    else:
        path, records = _read_records(spec, base_dir, where)
        env = env_cls(path.parent)
        try:
            tasks = env.load_tasks(records)
        except ValueError as exc:
            raise EpisodeError(f"{where}.path: {path}: {exc}") from None
    if not tasks:
        raise EpisodeError(f"{where}: no tasks")
    return env, tasks
