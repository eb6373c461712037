"""The sandbox gRPC service over a real channel, and a SIGKILLed service whose successor reaps
what it left behind."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import grpc
import pytest

from kiln.protos.kiln.v1 import sandbox_pb2, sandbox_pb2_grpc
from kiln.services.common.server import Registration, create_server
from kiln.services.sandbox.config import BubblewrapConfig
from kiln.services.sandbox.factory import leftovers
from kiln.services.sandbox.servicer import SandboxServicer
from kiln.services.sandbox.sessions import PoolConfig, SessionManager

EXAMPLES = Path(__file__).resolve().parents[2] / "deploy" / "examples" / "tasks"
TASK = (EXAMPLES / "terminal.jsonl").read_text().splitlines()[0]


async def _serve(config, pool):
    manager = SessionManager(config, pool)
    await manager.start()
    server, port = await create_server("127.0.0.1:0", [Registration(
        sandbox_pb2_grpc.add_SandboxServicer_to_server, SandboxServicer(manager),
        "kiln.v1.Sandbox")])
    return manager, server, port


def test_session_lifecycle_over_grpc():
    config = BubblewrapConfig(owner=f"g{uuid.uuid4().hex[:8]}")

    async def go():
        manager, server, port = await _serve(config, PoolConfig(max_concurrent=4, warm_pool=2,
                                                                tasks_dir=EXAMPLES))
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                stub = sandbox_pb2_grpc.SandboxStub(ch)
                s = await stub.CreateSession(sandbox_pb2.CreateSessionRequest(
                    owner="rollout-0", task_json=TASK, ttl_seconds=60))
                assert s.task_id == "count-words"
                sid = s.session_id
                bad = await stub.Verify(sandbox_pb2.VerifyRequest(session_id=sid))
                assert bad.reward == 0.0
                r = await stub.Exec(sandbox_pb2.ExecRequest(
                    session_id=sid, shell="wc -w < data/words.txt > count.txt; cat count.txt"))
                assert r.exit_code == 0 and r.stdout.strip() == "5"
                good = await stub.Verify(sandbox_pb2.VerifyRequest(session_id=sid))
                assert good.reward == 1.0 and good.parts["tests_passed"] == 1.0
                await stub.WriteFile(sandbox_pb2.WriteFileRequest(session_id=sid, path="x/y.txt",
                                                                  data=b"hi"))
                got = await stub.ReadFile(sandbox_pb2.ReadFileRequest(session_id=sid,
                                                                      path="/workspace/x/y.txt"))
                assert got.data == b"hi"
                argv = await stub.Exec(sandbox_pb2.ExecRequest(
                    session_id=sid, argv=sandbox_pb2.ArgvCommand(args=["cat"]), stdin=b"piped",
                    timeout_seconds=5))
                assert argv.stdout == "piped"
                t = await stub.Exec(sandbox_pb2.ExecRequest(session_id=sid, shell="sleep 10",
                                                            timeout_seconds=0.5))
                assert t.timed_out and t.exit_code == 124
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.ReadFile(sandbox_pb2.ReadFileRequest(session_id=sid,
                                                                    path="../../etc/passwd"))
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.CreateSession(sandbox_pb2.CreateSessionRequest(
                        owner="rollout-0", task_json='{"id": "t", "type": "terminal"}'))
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "field 'description'" in err.value.details()
                d = await stub.DestroySession(sandbox_pb2.DestroySessionRequest(session_id=sid))
                assert d.destroyed
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.Exec(sandbox_pb2.ExecRequest(session_id=sid, shell="true"))
                assert err.value.code() == grpc.StatusCode.NOT_FOUND
        finally:
            await server.stop(0)
            await manager.close()

    asyncio.run(go())
    assert leftovers(config) == []


def test_concurrency_limit_and_ttl():
    config = BubblewrapConfig(owner=f"g{uuid.uuid4().hex[:8]}")

    async def go():
        manager = SessionManager(config, PoolConfig(max_concurrent=2, acquire_timeout_s=0.3))
        await manager.start()
        try:
            a = await manager.create("o1", ttl_s=0.2)
            await manager.create("o2", ttl_s=60)
            from kiln.services.sandbox.sessions import CapacityError
            with pytest.raises(CapacityError):
                await manager.create("o3")
            await asyncio.sleep(0.3)
            assert await manager.expire() == 1
            assert a.id not in manager.sessions
            await manager.create("o3")  # room again once the idle session expired
            assert await manager.destroy_owner("o2") == 1
        finally:
            await manager.close()

    asyncio.run(go())
    assert leftovers(config) == []


def _procs_with(token: str) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if token.encode() in f.read():
                    found.append(int(pid))
        except OSError:
            continue
    return found


def _start_service(owner: str, port_file: Path) -> subprocess.Popen:
    port_file.unlink(missing_ok=True)
    proc = subprocess.Popen([sys.executable, "-m", "kiln.services.sandbox.main", "--address",
                             "127.0.0.1:0", "--metrics-port", "0", "--port-file", str(port_file),
                             "--owner", owner, "--tasks-dir", str(EXAMPLES)])
    deadline = time.monotonic() + 60
    while not port_file.exists():
        assert proc.poll() is None, "service exited early"
        assert time.monotonic() < deadline, "service did not start"
        time.sleep(0.1)
    return proc


def _wait_serving(port: int) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        deadline = time.monotonic() + 60
        while True:
            try:
                r = stub.Check(health_pb2.HealthCheckRequest(service="kiln.v1.Sandbox"))
                if r.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            assert time.monotonic() < deadline
            time.sleep(0.1)


@pytest.mark.slow
def test_killed_service_is_cleaned_up_by_its_successor(tmp_path):
    owner = f"k{uuid.uuid4().hex[:8]}"
    config = BubblewrapConfig(owner=owner)
    port_file = tmp_path / "ports.json"
    proc = _start_service(owner, port_file)
    try:
        port = json.loads(port_file.read_text())["port"]
        _wait_serving(port)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = sandbox_pb2_grpc.SandboxStub(ch)
            for _ in range(3):
                sid = stub.CreateSession(sandbox_pb2.CreateSessionRequest(owner="r0")).session_id
            # A long exec in flight when the service dies.
            token = str(3000 + uuid.uuid4().int % 1000)
            fut = stub.Exec.future(sandbox_pb2.ExecRequest(
                session_id=sid, shell=f"setsid sleep {token} & sleep {token}",
                timeout_seconds=300))
            time.sleep(1.0)
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            with pytest.raises(grpc.RpcError):
                fut.result(timeout=10)
        assert len(leftovers(config)) == 3  # cgroups and workspaces of the dead service
        proc = _start_service(owner, port_file)
        _wait_serving(json.loads(port_file.read_text())["port"])
        assert leftovers(config) == []
        assert not _procs_with(f"sleep\x00{token}")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    assert leftovers(config) == []


def test_the_job_sets_the_limits_not_the_caller(monkeypatch):
    """A caller asking for the network, 1 TiB and 10^9 s gets the job's limits; nothing of the
    service's environment is readable inside, from any process's /proc/*/environ."""
    from kiln.services.sandbox.config import SandboxLimits

    monkeypatch.setenv("KILN_SECRET_TOKEN", "do-not-leak-me")
    job_limits = SandboxLimits(memory_bytes=256 << 20, pids=64, cpu=0.5, timeout_seconds=3,
                               network=False, disk_bytes=16 << 20)
    config = BubblewrapConfig(owner=f"g{uuid.uuid4().hex[:8]}", limits=job_limits)

    async def go():
        manager, server, port = await _serve(config, PoolConfig(max_concurrent=2, warm_pool=0,
                                                                tasks_dir=EXAMPLES))
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                stub = sandbox_pb2_grpc.SandboxStub(ch)
                s = await stub.CreateSession(sandbox_pb2.CreateSessionRequest(
                    owner="rollout-0", ttl_seconds=60, limits=sandbox_pb2.Limits(
                        memory_bytes=1 << 40, pids=10**6, cpu=64, timeout_seconds=10**9,
                        network=True, disk_bytes=1 << 40)))
                limits = manager.get(s.session_id).sandbox.limits
                assert limits == job_limits  # capped, field by field
                # The job's 16 MiB workspace: a bigger file is refused, and says why.
                with pytest.raises(grpc.aio.AioRpcError) as exc:
                    await stub.WriteFile(sandbox_pb2.WriteFileRequest(
                        session_id=s.session_id, path="big.bin", data=b"0" * (20 << 20)))
                assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert "workspace quota of 16777216 bytes" in exc.value.details()
                r = await stub.Exec(sandbox_pb2.ExecRequest(
                    session_id=s.session_id, timeout_seconds=10**9,
                    shell="cat /proc/[0-9]*/environ 2>/dev/null | tr '\\0' '\\n'; "
                          "cat /sys/class/net/*/address 2>/dev/null | wc -l; sleep 10"))
                assert "do-not-leak-me" not in r.stdout and "KILN_" not in r.stdout
                assert r.timed_out and r.duration_seconds < 8  # the job's 3 s, not 10^9
                # Asking for less is fine.
                small = await stub.CreateSession(sandbox_pb2.CreateSessionRequest(
                    owner="rollout-0", ttl_seconds=60, limits=sandbox_pb2.Limits(memory_bytes=64 << 20)))
                assert manager.get(small.session_id).sandbox.limits.memory_bytes == 64 << 20
        finally:
            await server.stop(0)
            await manager.close()

    asyncio.run(go())


def test_episode_sandboxes_count_against_the_services_limit():
    """Sessions and episodes draw from one bound on living sandboxes: with a limit of 2 and
    two episodes holding sandboxes, a session cannot be created until one episode closes."""
    from kiln.api.validate import load_job
    from kiln.services.sandbox.episodes import EpisodeManager

    job = load_job(Path(__file__).resolve().parents[2] / "deploy" / "examples" / "terminal-quickstart.yaml")
    config = BubblewrapConfig(owner=f"g{uuid.uuid4().hex[:8]}")

    async def go():
        manager = SessionManager(config, PoolConfig(max_concurrent=2, warm_pool=0,
                                                    acquire_timeout_s=0.5, tasks_dir=EXAMPLES))
        await manager.start()
        episodes = EpisodeManager(job, base_dir=Path(__file__).resolve().parents[2],
                                  config=config.model_copy(update={"owner": config.owner + "-ep"}),
                                  room=manager.room, room_timeout_s=0.5)
        try:
            task_set = job.spec.tasks[0].name
            opened = [episodes.open(task_set, i) for i in range(2)]
            for info in opened:
                await episodes._start_sandbox(episodes._episodes[info.episode_id])
            with pytest.raises(Exception, match="sandboxes busy"):
                await manager.create("rollout-0")
            await episodes.close(opened[0].episode_id)
            session = await manager.create("rollout-0")  # room again
            await manager.destroy(session.id)
        finally:
            await episodes.close_all()
            await manager.close()

    asyncio.run(go())


def test_one_owner_cannot_take_every_sandbox():
    """With maxPerOwner 2, concurrent creates of one owner get two sandboxes and a retryable
    refusal; another owner still gets one; ending a session gives the owner its room back."""
    from kiln.services.sandbox.sessions import CapacityError

    config = BubblewrapConfig(owner=f"g{uuid.uuid4().hex[:8]}")

    async def go():
        manager = SessionManager(config, PoolConfig(max_concurrent=4, max_per_owner=2,
                                                    warm_pool=0, tasks_dir=EXAMPLES))
        await manager.start()
        try:
            results = await asyncio.gather(*(manager.create("rollout-0") for _ in range(3)),
                                           return_exceptions=True)
            made = [r for r in results if not isinstance(r, BaseException)]
            refused = [r for r in results if isinstance(r, BaseException)]
            assert len(made) == 2 and len(refused) == 1
            assert isinstance(refused[0], CapacityError) and refused[0].retryable
            assert "maxPerOwner = 2" in str(refused[0])
            other = await manager.create("rollout-1")
            assert other.owner == "rollout-1"
            await manager.destroy(made[0].id)
            again = await manager.create("rollout-0")
            assert again.owner == "rollout-0"
        finally:
            await manager.close()

    asyncio.run(go())
    assert leftovers(config) == []


@pytest.mark.slow
def test_a_hung_service_fails_its_callers_deadlines_and_serves_again(tmp_path):
    """A sandbox service that stops answering (SIGSTOP: a stalled node, a stuck host) fails each
    call at the caller's deadline instead of hanging it; resumed, it serves the same session
    again, and nothing it started is lost or left behind."""
    owner = f"h{uuid.uuid4().hex[:8]}"
    config = BubblewrapConfig(owner=owner)
    port_file = tmp_path / "ports.json"
    proc = _start_service(owner, port_file)
    try:
        port = json.loads(port_file.read_text())["port"]
        _wait_serving(port)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = sandbox_pb2_grpc.SandboxStub(ch)
            sid = stub.CreateSession(sandbox_pb2.CreateSessionRequest(owner="r0")).session_id
            stub.Exec(sandbox_pb2.ExecRequest(session_id=sid, shell="echo 1 > n"), timeout=30)
            os.kill(proc.pid, signal.SIGSTOP)
            t0 = time.monotonic()
            with pytest.raises(grpc.RpcError) as exc:
                stub.Exec(sandbox_pb2.ExecRequest(session_id=sid, shell="cat n"), timeout=3)
            assert exc.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert time.monotonic() - t0 < 10
            os.kill(proc.pid, signal.SIGCONT)
            r = stub.Exec(sandbox_pb2.ExecRequest(session_id=sid, shell="cat n"), timeout=30)
            assert r.exit_code == 0 and r.stdout.strip() == "1"
            stub.DestroySession(sandbox_pb2.DestroySessionRequest(session_id=sid), timeout=30)
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    assert leftovers(config) == []
