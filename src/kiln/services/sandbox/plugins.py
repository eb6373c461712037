"""Job plugins (`env: {plugin: ...}`, `reward: {plugin: ...}`), run outside the service.

The sandbox service is privileged (root in its pod, for cgroups, mounts and uid changes) and
holds the job's TLS key; a plugin is the job author's code. So the service never imports one:
each task set that names a plugin gets a worker process (`plugin_host.py`) and a stand-in
here that forwards the environment interface to it as data (`plugin_codec.py`), one JSON
object per line over the worker's stdin and stdout.

A root service confines the worker like a sandbox, less the workspace: its own uid, no
capabilities, no network, a read-only view of what Python needs (`plugin_confinement.py`).

Sandboxes stay the service's: a plugin's `sandbox.exec` is a request the service carries out
on the episode's sandbox, for the duration of the call that handed the plugin that sandbox.

Not covered: the worker's side (`plugin_host.py`), how it is confined
(`plugin_confinement.py`); built-in environments, which are Kiln's own code and run in the
service. A plugin call that never returns holds its episode until rollout's deadline.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import json
import logging
import os
import subprocess
import sys
import threading
import uuid
from pathlib import Path
from typing import Any

from pydantic import ConfigDict, PrivateAttr

from kiln.env import Environment, Grade, Task, ToolCall, ToolResult, ToolSpec
from kiln.episode import Turn

from . import plugin_codec as codec
from .plugin_codec import PluginFailure
from .plugin_confinement import PLUGIN_UID, confined_argv

log = logging.getLogger(__name__)

#: How long loading a task set may take in the worker (interpreter start, imports, tasks).
LOAD_TIMEOUT_S = 300.0


class PluginWorker:
    """One confined worker process and the calls in flight to it."""

    def __init__(self, name: str, read_only: list[Path], memory_bytes: int | None = None) -> None:
        self.name = name
        env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(p for p in sys.path if p),
               "PYTHONDONTWRITEBYTECODE": "1", "LANG": "C.UTF-8"}
        # Not the service's environment: it may hold addresses and secrets.
        self.proc = subprocess.Popen(confined_argv(read_only, memory_bytes), stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=env, start_new_session=True)
        self._write_lock = threading.Lock()
        self._ids = itertools.count()
        self._pending: dict[str, concurrent.futures.Future] = {}
        self._sandboxes: dict[str, tuple[asyncio.AbstractEventLoop, Any]] = {}
        self._dead: str | None = None
        self._reader = threading.Thread(target=self._read, daemon=True,
                                        name=f"plugin-{name}")
        self._reader.start()

    # -- transport ----------------------------------------------------------------------------
    def _send(self, message: dict) -> None:
        line = json.dumps(message, ensure_ascii=False).encode() + b"\n"
        with self._write_lock:
            try:
                self.proc.stdin.write(line)
                self.proc.stdin.flush()
            except (BrokenPipeError, ValueError):
                raise PluginFailure(self._dead or f"plugin worker {self.name} is gone") from None

    def _read(self) -> None:
        reason = "exited"
        try:
            while True:
                line = self.proc.stdout.readline(codec.MAX_LINE_BYTES + 1)
                if not line:
                    break
                if not line.endswith(b"\n"):
                    reason = f"sent a message over {codec.MAX_LINE_BYTES} bytes"
                    self.proc.kill()
                    break
                try:
                    message = json.loads(line)
                    self._dispatch(message)
                except (ValueError, KeyError, TypeError) as exc:
                    reason = f"broke the protocol ({type(exc).__name__}: {exc})"
                    self.proc.kill()
                    break
        finally:
            code = self.proc.wait()
            self._dead = f"plugin worker {self.name} {reason} (exit code {code})"
            for fut in list(self._pending.values()):
                if not fut.done():
                    fut.set_exception(PluginFailure(self._dead))
            self._pending.clear()

    def _dispatch(self, message: dict) -> None:
        if "sandbox" in message:
            held = self._sandboxes.get(message["sandbox"])
            if held is None:
                self._send({"id": message["id"], "type": "SandboxError",
                            "error": "this sandbox handle is not valid outside the call that "
                                     "passed it"})
                return
            loop, sandbox = held
            try:
                asyncio.run_coroutine_threadsafe(self._sandbox_op(sandbox, message), loop)
            except RuntimeError:  # the caller's event loop is gone
                self._send({"id": message["id"], "type": "SandboxError",
                            "error": "the call that passed this sandbox has ended"})
            return
        fut = self._pending.pop(str(message["id"]), None)
        if fut is None or fut.done():
            return
        if "error" in message:
            kind = message.get("kind")
            error = str(message["error"])
            fut.set_exception(NotImplementedError(error) if kind == "not_implemented" else
                              ValueError(error) if kind == "value" else PluginFailure(error))
        else:
            fut.set_result(message.get("ok"))

    async def _sandbox_op(self, sandbox, message: dict) -> None:
        op, args = message["op"], message.get("args") or {}
        try:
            if op == "exec":
                stdin = args.get("stdin")
                result = await sandbox.exec(args["cmd"], timeout=args.get("timeout"),
                                            workdir=args.get("workdir"), env=args.get("env"),
                                            stdin=None if stdin is None else codec.blob_in(stdin))
                reply = {"ok": codec.exec_result_out(result)}
            elif op == "read_file":
                reply = {"ok": codec.blob_out(await sandbox.read_file(args["path"],
                                                                     args.get("max_bytes")))}
            elif op == "write_file":
                await sandbox.write_file(args["path"], codec.blob_in(args["data"]),
                                         int(args.get("mode", 0o644)) & 0o777)
                reply = {"ok": None}
            else:
                reply = {"type": "ValueError", "error": f"unknown sandbox operation {op!r}"}
        except Exception as exc:  # the plugin sees the sandbox's error, as in-process
            reply = {"type": type(exc).__name__, "error": str(exc)}
        try:
            self._send({"id": message["id"], **reply})
        except PluginFailure:
            pass  # the worker died meanwhile; its callers get the reason

    def _call(self, method: str, args: dict) -> concurrent.futures.Future:
        rid = str(next(self._ids))
        fut: concurrent.futures.Future = concurrent.futures.Future()
        if self._dead:
            fut.set_exception(PluginFailure(self._dead))
            return fut
        self._pending[rid] = fut
        try:
            self._send({"id": rid, "call": method, "args": args})
        except PluginFailure as exc:
            self._pending.pop(rid, None)
            fut.set_exception(exc)
        return fut

    def call_blocking(self, method: str, args: dict, timeout: float) -> Any:
        try:
            return self._call(method, args).result(timeout)
        except concurrent.futures.TimeoutError:
            raise PluginFailure(f"plugin worker {self.name}: {method} took over {timeout:g} s") from None

    async def call(self, method: str, args: dict, sandbox: Any = None) -> Any:
        token = None
        if sandbox is not None:
            token = uuid.uuid4().hex
            self._sandboxes[token] = (asyncio.get_running_loop(), sandbox)
            args = {**args, "sandbox": token}
        try:
            return await asyncio.wrap_future(self._call(method, args))
        finally:
            if token is not None:
                self._sandboxes.pop(token, None)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self._reader.join(10)
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                stream.close()
            except OSError:
                pass


class PluginTask(Task):
    """A task as the service holds it when a plugin made it: its fields as the plugin's model
    dumped them, and what the episode's opening needs (the plugin's prompts and tools)."""

    model_config = ConfigDict(extra="allow")
    _ref: dict = PrivateAttr(default_factory=dict)
    _opening: dict = PrivateAttr(default_factory=dict)


def _plugin_task(entry: Any) -> PluginTask:
    if not isinstance(entry, dict) or not isinstance(entry.get("fields"), dict):
        raise PluginFailure("a task entry from the plugin worker is malformed")
    try:
        task = PluginTask.model_validate(entry["fields"])
    except ValueError as exc:
        raise PluginFailure(f"a task from the plugin is malformed: {exc}") from None
    task._ref = {"handle": codec._str(entry.get("handle"), "task handle")}
    reference = entry.get("reference")
    task._opening = {
        "system": codec._str(entry.get("system", ""), "system_prompt"),
        "user": codec._str(entry.get("user"), "user_prompt"),
        "tools": [codec.tool_spec_in(t) for t in codec._list(entry.get("tools"), "tools")],
        "reference": None if reference is None else codec._str(reference, "reference")}
    return task


def _ref(task: Task) -> dict:
    return task._ref if isinstance(task, PluginTask) else {"value": task.model_dump(mode="json")}


class PluginEnvironment(Environment):
    """The service's stand-in for an environment plugin running in a worker."""

    task_model = PluginTask

    def __init__(self, worker: PluginWorker, base_dir: Path, needs_sandbox: bool,
                 end_on_invalid_action: bool) -> None:
        super().__init__(base_dir)
        self.worker = worker
        self.needs_sandbox = needs_sandbox
        self.end_on_invalid_action = end_on_invalid_action

    def system_prompt(self, task: Task) -> str:
        return task._opening["system"]

    def user_prompt(self, task: Task) -> str:
        return task._opening["user"]

    def tools(self, task: Task) -> list[ToolSpec]:
        return list(task._opening["tools"])

    def reference(self, task: Task) -> str | None:
        return task._opening["reference"]

    async def setup(self, sandbox, task: Task) -> None:
        await self.worker.call("setup", {"task": _ref(task)}, sandbox)

    async def call_tool(self, sandbox, task: Task, call: ToolCall) -> ToolResult:
        return codec.tool_result_in(await self.worker.call(
            "call_tool", {"task": _ref(task), "call": codec.tool_call_out(call)}, sandbox))

    async def grade(self, sandbox, task: Task, answer: str | None) -> Grade:
        return codec.grade_in(await self.worker.call(
            "grade", {"task": _ref(task), "answer": answer}, sandbox))

    def subtask(self, task, role, instructions, assigned, *, index=0):
        raise NotImplementedError("a plugin's sub-tasks are asked for with subtask_async")

    async def subtask_async(self, task: Task, role: str, instructions: str, assigned: str, *,
                            index: int = 0) -> PluginTask:
        return _plugin_task(await self.worker.call("subtask", {
            "task": _ref(task), "role": role, "instructions": instructions,
            "assigned": assigned, "index": index}))

    async def demonstrate_async(self, task: Task, seed: int):
        turns = await self.worker.call("demonstrate", {"task": _ref(task), "seed": seed})
        return None if turns is None else [codec.assistant_turn_in(t)
                                           for t in codec._list(turns, "demonstration")]

    async def grade_demonstration_async(self, task: Task, turns) -> Grade | None:
        grade = await self.worker.call("grade_demonstration", {
            "task": _ref(task), "turns": [codec.assistant_turn_out(t) for t in turns]})
        return None if grade is None else codec.grade_in(grade)


class PluginReward:
    """The service's stand-in for a reward plugin: `await reward(task, grade, transcript)`."""

    def __init__(self, worker: PluginWorker) -> None:
        self.worker = worker

    async def __call__(self, task: Task, grade: Grade, transcript: list[Turn]) -> Grade | float:
        out = codec._dict(await self.worker.call("reward", {
            "task": _ref(task), "grade": codec.grade_out(grade),
            "transcript": [codec.turn_out(t) for t in transcript]}), "reward")
        if "grade" in out:
            return codec.grade_in(out["grade"])
        return codec._float(out.get("reward"), "reward")


def load_plugins(name: str, env: str | None, builtin: str | None, reward: str | None,
                 base_dir: Path, records: list | None, read_only: list[Path],
                 memory_bytes: int | None = None) -> tuple[PluginEnvironment | None, list[PluginTask], PluginReward | None,
                            PluginWorker]:
    """A worker for one task set, its plugins loaded. `env`: the environment plugin's
    reference (its tasks made from `records`), or None with `builtin` the built-in environment
    a reward plugin is paired with. ValueError (the plugin cannot be used: its message names
    what) or PluginFailure (the worker failed)."""
    worker = PluginWorker(name, [base_dir, *read_only], memory_bytes)
    try:
        out = codec._dict(worker.call_blocking("load", {
            "env": env, "builtin": builtin, "reward": reward, "base_dir": str(base_dir),
            "records": records}, LOAD_TIMEOUT_S), "load")
        tasks = [_plugin_task(e) for e in codec._list(out.get("tasks"), "tasks")]
        environment = (PluginEnvironment(worker, base_dir, bool(out.get("needs_sandbox")),
                                         bool(out.get("end_on_invalid_action")))
                       if env is not None else None)
    except BaseException:
        worker.close()
        raise
    log.info("task set %s: plugins run in worker pid %d (%s)", name, worker.proc.pid,
             f"uid {PLUGIN_UID}, bubblewrap" if os.geteuid() == 0 else f"uid {os.geteuid()}")
    return environment, tasks, PluginReward(worker) if reward else None, worker
