"""A plugin worker: one job task set's environment or reward plugin, run outside the service.

    python -m kiln.services.sandbox.plugin_host     (started by `plugins.py`, never by hand)

The sandbox service runs privileged (root, for cgroups and mounts) and holds the job's TLS
key; a plugin is code the job's author wrote. So the service never imports it: it starts this
process confined (`plugins.py`: a bubblewrap namespace with a read-only view of the
interpreter, the Python path and the task folders, an unprivileged uid of its own, no
capabilities, no network), and this process tightens itself further before the first line
of plugin code runs: the sandboxes' seccomp deny-list with no_new_privs (`seccomp.py`) and
resource limits. Then it imports the plugin and serves the environment interface over its
standard input and output, one JSON object per line (`plugin_codec.py`); the plugin's own
prints go to standard error, the service's log.

The plugin sees the same `Environment` API as in-process: its `sandbox` argument is a handle
whose `exec`, `read_file` and `write_file` are requests back to the service, valid for the
call that passed it.

Not covered: starting and confining this process (`plugins.py`).
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import resource
import sys
import threading
import traceback
from typing import Any

#: Resource limits the worker sets on itself: no core dumps (they would hold the plugin's
#: memory on disk), a bounded number of open files and of files written; its address space
#: (`--memory-bytes`, the job's `sandbox.pluginMemory`) comes on top.
LIMITS = {resource.RLIMIT_CORE: 0, resource.RLIMIT_NOFILE: 4096,
          resource.RLIMIT_FSIZE: 1 << 30}
#: Processes and threads of the plugins' own uid, all workers together (set only when the
#: worker runs as that uid, not as the service's: the count is per uid).
PLUGIN_PROCESSES = 512

#: Exceptions a sandbox request may end with, raised again in the plugin as their own type
#: (the environment API documents them: FileNotFoundError from read_file, ...).
_ERRORS: dict[str, type[BaseException]] = {
    e.__name__: e for e in (FileNotFoundError, IsADirectoryError, NotADirectoryError,
                            PermissionError, TimeoutError, ValueError, OSError)}


class _SandboxProxy:
    """The sandbox handle a plugin's `setup`, `call_tool` and `grade` receive."""

    def __init__(self, host: "_Host", token: str) -> None:
        self._host, self._token = host, token

    async def exec(self, cmd, *, timeout=None, workdir=None, env=None, stdin=None):
        from kiln.services.sandbox.interface import ExecResult
        from kiln.services.sandbox.plugin_codec import blob_out
        res = await self._host.ask(self._token, "exec", {
            "cmd": cmd, "timeout": timeout, "workdir": workdir, "env": env,
            "stdin": None if stdin is None else blob_out(stdin)})
        return ExecResult(**res)

    async def read_file(self, path: str, max_bytes: int | None = None) -> bytes:
        from kiln.services.sandbox.plugin_codec import blob_in
        return blob_in(await self._host.ask(self._token, "read_file",
                                            {"path": path, "max_bytes": max_bytes}))

    async def write_file(self, path: str, data: bytes, mode: int = 0o644) -> None:
        from kiln.services.sandbox.plugin_codec import blob_out
        await self._host.ask(self._token, "write_file",
                             {"path": path, "data": blob_out(data), "mode": mode})


class _Host:
    def __init__(self, out) -> None:
        self.out = out
        self.write_lock = threading.Lock()
        self.loop = asyncio.get_running_loop()
        self.pending: dict[str, asyncio.Future] = {}
        self.asked = 0
        self.env = None
        self.reward = None
        self.task_model = None
        self.tasks: dict[str, Any] = {}

    def send(self, message: dict) -> None:
        line = json.dumps(message, ensure_ascii=False).encode() + b"\n"
        with self.write_lock:
            self.out.write(line)
            self.out.flush()

    async def ask(self, token: str | None, op: str, args: dict) -> Any:
        if token is None:
            raise RuntimeError("this environment has no sandbox (needs_sandbox is False)")
        self.asked += 1
        rid = f"s{self.asked}"
        fut = self.pending[rid] = self.loop.create_future()
        self.send({"id": rid, "sandbox": token, "op": op, "args": args})
        return await fut

    def answered(self, message: dict) -> None:
        fut = self.pending.pop(message["id"], None)
        if fut is None or fut.done():
            return
        if "error" in message:
            from kiln.services.sandbox.interface import SandboxError
            fut.set_exception(_ERRORS.get(message.get("type"), SandboxError)(message["error"]))
        else:
            fut.set_result(message.get("ok"))

    # -- calls from the service --------------------------------------------------------------
    async def serve(self, message: dict) -> None:
        try:
            result = await getattr(self, "do_" + message["call"])(**message["args"])
            reply = {"id": message["id"], "ok": result}
        except NotImplementedError as exc:
            reply = {"id": message["id"], "error": str(exc), "kind": "not_implemented"}
        except ValueError as exc:
            reply = {"id": message["id"], "error": f"{type(exc).__name__}: {exc}", "kind": "value"}
        except Exception as exc:  # the plugin's failure, reported to the service with its trace
            traceback.print_exc(file=sys.stderr)
            reply = {"id": message["id"], "error": f"{type(exc).__name__}: {exc}", "kind": "plugin"}
        self.send(reply)

    def _task(self, ref: dict):
        if "handle" in ref:
            return self.tasks[ref["handle"]]
        return self.task_model.model_validate(ref["value"])

    def _entry(self, handle: str, task) -> dict:
        from kiln.services.sandbox.plugin_codec import tool_spec_out
        env = self.env
        self.tasks[handle] = task
        return {"handle": handle, "fields": task.model_dump(mode="json"),
                "system": env.system_prompt(task), "user": env.user_prompt(task),
                "tools": [tool_spec_out(t) for t in env.tools(task)],
                "reference": env.reference(task)}

    async def do_load(self, env: str | None, builtin: str | None, reward: str | None,
                      base_dir: str, records: list | None) -> dict:
        from pathlib import Path

        from kiln.env import PluginError, load_plugin
        try:
            if env is not None:
                env_cls = load_plugin(env, "environment")
            else:
                from kiln.services.sandbox.environments.tasks import builtin_environment
                env_cls = builtin_environment(builtin)
            self.reward = load_plugin(reward, "reward") if reward else None
        except PluginError as exc:
            raise ValueError(str(exc)) from None
        self.task_model = env_cls.task_model
        entries = []
        if env is not None:  # a built-in environment paired with a reward plugin stays the service's
            self.env = env_cls(Path(base_dir))
            tasks = self.env.load_tasks(records or [])
            entries = [self._entry(f"t{i}", t) for i, t in enumerate(tasks)]
        return {"tasks": entries, "needs_sandbox": bool(env_cls.needs_sandbox),
                "end_on_invalid_action": bool(getattr(env_cls, "end_on_invalid_action", False))}

    async def do_setup(self, task: dict, sandbox: str | None) -> None:
        await self.env.setup(_SandboxProxy(self, sandbox), self._task(task))

    async def do_call_tool(self, task: dict, sandbox: str | None, call: dict) -> dict:
        from kiln.services.sandbox.plugin_codec import tool_call_in, tool_result_out
        result = await self.env.call_tool(_SandboxProxy(self, sandbox), self._task(task),
                                          tool_call_in(call))
        return tool_result_out(result)

    async def do_grade(self, task: dict, sandbox: str | None, answer: str | None) -> dict:
        from kiln.services.sandbox.plugin_codec import grade_out
        return grade_out(await self.env.grade(_SandboxProxy(self, sandbox), self._task(task), answer))

    async def do_reward(self, task: dict, grade: dict, transcript: list) -> Any:
        from kiln.env import Grade
        from kiln.services.sandbox.plugin_codec import grade_in, grade_out, turn_in
        custom = self.reward(self._task(task), grade_in(grade), [turn_in(t) for t in transcript])
        if asyncio.iscoroutine(custom):
            custom = await custom
        return {"grade": grade_out(custom)} if isinstance(custom, Grade) else {"reward": float(custom)}

    async def do_subtask(self, task: dict, role: str, instructions: str, assigned: str,
                         index: int) -> dict:
        sub = self.env.subtask(self._task(task), role, instructions, assigned, index=index)
        return self._entry(f"s{len(self.tasks)}", sub)

    async def do_demonstrate(self, task: dict, seed: int) -> list | None:
        from kiln.services.sandbox.plugin_codec import assistant_turn_out
        turns = self.env.demonstrate(self._task(task), random.Random(seed))
        return None if turns is None else [assistant_turn_out(t) for t in turns]

    async def do_grade_demonstration(self, task: dict, turns: list) -> dict | None:
        from kiln.services.sandbox.plugin_codec import assistant_turn_in, grade_out
        grade = self.env.grade_demonstration(self._task(task), [assistant_turn_in(t) for t in turns])
        return None if grade is None else grade_out(grade)


def confine(memory_bytes: int | None = None) -> None:
    """Tighten this process before any plugin code runs: resource limits, then the syscall
    filter (which sets no_new_privs: nothing exec'd later gains privileges)."""
    from kiln.services.sandbox.plugin_confinement import PLUGIN_UID

    limits = dict(LIMITS)
    if memory_bytes:
        limits[resource.RLIMIT_AS] = memory_bytes
    if os.getuid() == PLUGIN_UID:
        limits[resource.RLIMIT_NPROC] = PLUGIN_PROCESSES
    for which, value in limits.items():
        soft, hard = resource.getrlimit(which)
        value = value if hard == resource.RLIM_INFINITY else min(value, hard)
        resource.setrlimit(which, (value, value))
    from kiln.services.sandbox import seccomp
    seccomp.load()


async def _main(protocol_in, protocol_out) -> None:
    host = _Host(protocol_out)
    queue: asyncio.Queue = asyncio.Queue()

    def read() -> None:
        # A thread of its own: the service's writes are drained whatever the plugin does.
        for line in protocol_in:
            host.loop.call_soon_threadsafe(queue.put_nowait, line)
        host.loop.call_soon_threadsafe(queue.put_nowait, None)

    threading.Thread(target=read, daemon=True, name="plugin-protocol").start()
    running: set[asyncio.Task] = set()
    while (line := await queue.get()) is not None:
        message = json.loads(line)
        if "call" in message:
            task = asyncio.ensure_future(host.serve(message))
            running.add(task)
            task.add_done_callback(running.discard)
        else:
            host.answered(message)


def main() -> int:
    # The protocol keeps private copies of stdin and stdout; fd 1 then points at stderr so
    # a plugin's print() lands in the service's log instead of corrupting the protocol.
    protocol_in = os.fdopen(os.dup(0), "rb", buffering=0)
    protocol_out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    sys.stdout = sys.stderr
    memory = sys.argv[sys.argv.index("--memory-bytes") + 1] if "--memory-bytes" in sys.argv else None
    confine(int(memory) if memory else None)
    asyncio.run(_main(protocol_in, protocol_out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
