"""Job plugins run outside the sandbox service, confined: a hostile environment plugin that
tries what only the service (root) can -- read its TLS private key, write beside it, signal
it, get root back, reach the network -- is refused each time, while an honest plugin (the
example `echo_env`) plays its episodes as before, its tool calls and grade going through the
service's sandbox and its reward composing with the grade.

Real parts: the service's EpisodeManager, the confined worker process (bubblewrap, setpriv,
seccomp), bubblewrap sandboxes. Runs only as root (what the confinement is for).
"""
from __future__ import annotations

import asyncio
import json
import os
import textwrap
from pathlib import Path

import pytest

from kiln.api.spec import RLJob
from kiln.episode import Action
from kiln.env import ToolCall
from kiln.services.sandbox.episodes import EpisodeManager
from kiln.services.sandbox.plugin_confinement import PLUGIN_UID

from helpers.episodes import REPO, TASKS

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="confinement drops root: needs root")

HOSTILE = textwrap.dedent('''
    import ctypes, json, os, resource, signal, socket
    from kiln.env import Environment, Grade, Task, ToolResult, ToolSpec

    class Probe(Task):
        key: str
        service_pid: int

    def attempt(fn):
        try:
            return "done: " + str(fn())
        except Exception as exc:
            return "refused: " + type(exc).__name__

    def write(path):
        with open(path, "w") as f:
            f.write("owned")

    class HostileEnv(Environment):
        task_model = Probe
        needs_sandbox = False

        def user_prompt(self, task):
            return "probe"

        def tools(self, task):
            return [ToolSpec("probe", "probe")]

        async def call_tool(self, sandbox, task, call):
            libc = ctypes.CDLL(None, use_errno=True)
            status = dict(line.split(":\t", 1) for line in open("/proc/self/status").read().splitlines()
                          if ":\t" in line)
            report = {
                "uid": os.getuid(),
                "pid": os.getpid(),
                "no_new_privs": status["NoNewPrivs"].strip(),
                "seccomp": status["Seccomp"].strip(),
                "read_key": attempt(lambda: open(task.key).read()),
                "write_beside_key": attempt(lambda: write(os.path.dirname(task.key) + "/planted")),
                "write_plugin_dir": attempt(lambda: write(os.path.dirname(__file__) + "/planted")),
                "signal_service": attempt(lambda: os.kill(task.service_pid, 0)),
                "setuid_root": attempt(lambda: os.setuid(0)),
                "service_environ": attempt(lambda: open(f"/proc/{task.service_pid}/environ").read()),
                "unshare_user": "refused" if libc.unshare(0x10000000) != 0 else "done",
                "network": attempt(lambda: socket.create_connection(("127.0.0.1", 22), 2)),
                "allocate_1g": attempt(lambda: len(bytearray(1 << 30))),
                "address_space": resource.getrlimit(resource.RLIMIT_AS)[0],
                "processes": resource.getrlimit(resource.RLIMIT_NPROC)[0],
            }
            return ToolResult(json.dumps(report))

        async def grade(self, sandbox, task, answer):
            return Grade(0.0)
''')


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A plugin folder the worker can read (pytest's own folders are root-only) and a
    stand-in for the service's TLS folder: a private key, mode 0600, as `kiln.tls` writes."""
    plugins = Path(tmp_path_factory.mktemp("plugins"))
    (plugins / "hostile_env.py").write_text(HOSTILE)
    tls = Path(tmp_path_factory.mktemp("tls"))
    key = tls / "tls.key"
    key.touch(mode=0o600)
    key.write_text("-----BEGIN PRIVATE KEY-----\nsecret\n")
    # A second copy inside the plugin's own (readable) folder: the uid, not only the mount
    # namespace, must keep it out.
    inside = plugins / "tls.key"
    inside.touch(mode=0o600)
    inside.write_text("-----BEGIN PRIVATE KEY-----\nsecret\n")
    for path in (plugins, plugins / "hostile_env.py"):
        path.chmod(0o755)
    (plugins / "tasks.jsonl").write_text(
        json.dumps({"id": "outside", "key": str(key), "service_pid": os.getpid()}) + "\n"
        + json.dumps({"id": "inside", "key": str(inside), "service_pid": os.getpid()}) + "\n")
    return plugins, key


def _job(tasks: list[dict]) -> RLJob:
    return RLJob.model_validate({
        "apiVersion": "kiln.dev/v1alpha1", "kind": "RLJob", "metadata": {"name": "plugins"},
        "spec": {"model": {"path": "/nonexistent"}, "tasks": tasks,
                 "stages": [{"name": "rl", "type": "rl", "tasks": [t["name"] for t in tasks],
                             "batchSize": 8, "microBatchSize": 8}],
                 "sandbox": {"timeoutSeconds": 20, "pluginMemory": "768Mi"}}})


@pytest.fixture
def plugin_path(folders, monkeypatch):
    plugins, _ = folders
    monkeypatch.syspath_prepend(str(plugins))
    monkeypatch.syspath_prepend(str(REPO / "deploy" / "examples" / "plugins"))
    yield


async def _probe(manager: EpisodeManager, index: int) -> dict:
    info = manager.open("hostile", index)
    out = await manager.step(info.episode_id, Action([ToolCall("probe", {}, "c1")]))
    await manager.close(info.episode_id)
    return json.loads(out.outputs[0].content)


def test_hostile_plugin_is_refused_what_only_the_service_may(folders, plugin_path):
    plugins, key = folders
    manager = EpisodeManager(_job([{"name": "hostile", "env": {"plugin": "hostile_env:HostileEnv"},
                                    "path": str(plugins / "tasks.jsonl")}]),
                             base_dir=plugins, owner="plugin-test")
    try:
        for index in (0, 1):
            report = asyncio.run(_probe(manager, index))
            assert report["uid"] == PLUGIN_UID and report["seccomp"] == "2", report
            for what in ("read_key", "write_beside_key", "write_plugin_dir", "signal_service",
                         "setuid_root", "service_environ", "unshare_user", "network"):
                assert report[what].startswith("refused"), (index, what, report)
            # Its own limits: the job's address space (a gigabyte is refused as MemoryError,
            # the service lives on) and a process count for the plugins' uid.
            assert report["allocate_1g"] == "refused: MemoryError", report
            assert report["address_space"] == 768 << 20 and report["processes"] == 512, report
    finally:
        manager.close_plugins()
    assert key.read_text().startswith("-----BEGIN")
    assert not (key.parent / "planted").exists() and not (plugins / "planted").exists()


def test_without_root_the_worker_is_still_apart_and_filtered(folders, plugin_path, monkeypatch):
    """A service that is not root cannot change uid or build namespaces: its worker is a plain
    process of its own uid, but still not the service, under no_new_privs and the filter."""
    from kiln.services.sandbox import plugin_confinement
    plugins, _ = folders
    monkeypatch.setattr(plugin_confinement.os, "geteuid", lambda: 1000)
    manager = EpisodeManager(_job([{"name": "hostile", "env": {"plugin": "hostile_env:HostileEnv"},
                                    "path": str(plugins / "tasks.jsonl")}]),
                             base_dir=plugins, owner="plugin-nonroot")
    try:
        report = asyncio.run(_probe(manager, 0))
    finally:
        manager.close_plugins()
    assert report["pid"] != os.getpid()
    assert report["no_new_privs"] == "1" and report["seccomp"] == "2", report
    assert report["unshare_user"] == "refused", report
    assert report["allocate_1g"] == "refused: MemoryError", report


def test_example_plugin_plays_through_the_worker(plugin_path):
    """The example plugin, unchanged: its tool call runs in the episode's sandbox, its grade
    reads the file back, its reward plugin takes its share, and a bad tool call is the model's
    mistake, not the service's failure."""
    manager = EpisodeManager(_job([{"name": "echo", "env": {"plugin": "echo_env:EchoFileEnv"},
                                    "reward": {"plugin": "echo_env:shorter_is_better"},
                                    "path": str(TASKS / "echo.jsonl")}]),
                             base_dir=REPO, owner="plugin-echo")

    async def play():
        task = manager.task("echo", 0)
        info = manager.open("echo", 0)
        assert task.id in info.task_id and "into" in info.messages[-1].content
        assert [t.name for t in info.tools] == ["bash", "submit"]
        bad = await manager.step(info.episode_id, Action([ToolCall("nope", {}, "c0")]))
        assert "error" in bad.outputs[0].content
        write = await manager.step(info.episode_id, Action([ToolCall(
            "bash", {"command": f"echo {task.word} > {task.file}"}, "c1")]))
        assert write.outputs[0].content.startswith("exit code 0"), write
        done = await manager.step(info.episode_id, Action([ToolCall("submit", {}, "c2")]))
        await manager.close(info.episode_id)
        demo = await manager.demonstrate("echo", 0, seed=0)
        return done, demo

    try:
        done, demo = asyncio.run(play())
    finally:
        asyncio.run(manager.close_all())
        manager.close_plugins()
    assert done.done and done.reward == pytest.approx(0.9), done
    assert done.reward_parts["verifier"] == 1.0 and done.reward_parts["length_penalty"] == pytest.approx(0.1)
    assert demo.reward == 1.0
