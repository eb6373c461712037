"""Start Kiln's services as local processes on loopback and wait until they are healthy.

Each service runs from the same entry point the operator runs in its pod (`python -m
kiln.services.<name>.main`), with the resolved job file, a free port (announced through a port
file), its own state directory under the run directory, its own certificate under
`RUN_DIR/tls/<component>/` (mutual TLS, as on a cluster), and a log file. Addresses of the other
services are passed in the same environment variables the operator sets (`KILN_<NAME>_ADDR`).

Not covered: what the services are told to do (`driver.py`).
"""
from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kiln.api.openai_endpoint import ANNOUNCE_ENV, HOST_ENV, PORT_ENV
from kiln.control import channels
from kiln.tls import TLS_DIR_ENV

# Start order: a service is started after the ones it talks to. A job with on-policy
# distillation also runs its teachers (`teacher`, `teacher_1`, ...: the rollout service serving a
# fixed checkpoint's scores, `--teacher DIR`), started before rollout.
ORDER = ("buffer", "sandbox", "weight_sync", "trainer", "rollout")
REPLICA_PREFIX = "trainer-replica-"
TEACHER = "teacher"
#: Rollout workers after the first (`rollout-1`, ...: `fleet.py`), each the rollout service.
ROLLOUT_WORKER_PREFIX = "rollout-"
#: Where a rollout worker announces its OpenAI endpoint's address, in its state folder.
ANNOUNCEMENT = "openai.json"


class ServiceFailed(RuntimeError):
    """A service process exited or never became healthy; its log says why."""


@dataclass
class ServiceProcess:
    name: str
    proc: subprocess.Popen
    state_dir: Path
    log_path: Path
    port: int = 0
    metrics_port: int = 0
    args: tuple[str, ...] = ()
    """Arguments after the common ones (a teacher's `--teacher DIR`); a restart passes them."""

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def env_var(name: str) -> str:
    return f"KILN_{name.upper()}_ADDR"


def start(name: str, job_file: Path, run_dir: Path, addresses: dict[str, str],
          extra_env: dict[str, str] | None = None, port: int = 0,
          args: tuple[str, ...] = ()) -> ServiceProcess:
    """Start service `name` (`trainer-replica-N`: data-parallel replica N of the trainer);
    `port` 0 picks a free one (a restart passes the old one, so the other services' channels
    reconnect to the same address)."""
    state = run_dir / name
    state.mkdir(parents=True, exist_ok=True)
    port_file = state / "ports.json"
    port_file.unlink(missing_ok=True)
    log_path = run_dir / "logs" / f"{name}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **{env_var(k): v for k, v in addresses.items()
                            if not k.startswith(ROLLOUT_WORKER_PREFIX)}, **(extra_env or {})}
    # Each service's own certificate (`issue_certificates`); the launcher's is the operator's.
    env[TLS_DIR_ENV] = str(run_dir / "tls" / identity_of(name))
    env.setdefault("KILN_LOG_FORMAT", "json")
    if name.startswith(ROLLOUT_WORKER_PREFIX):
        # Its own task stream (the producer salts the job's seed with it), across restarts too.
        env["KILN_ROLLOUT_REPLICA"] = name.removeprefix(ROLLOUT_WORKER_PREFIX)
    if name == "rollout" or name.startswith(ROLLOUT_WORKER_PREFIX):
        # Its OpenAI endpoint (if the job has one) on a free loopback port, announced for the
        # router, which holds `openaiPort` (`openai_access.LocalRouter`).
        env.update({PORT_ENV: "0", HOST_ENV: "127.0.0.1", ANNOUNCE_ENV: str(state / ANNOUNCEMENT)})
        (state / ANNOUNCEMENT).unlink(missing_ok=True)
    module = component_of(name).replace("-", "_")
    cmd = [sys.executable, "-m", f"kiln.services.{module}.main", "--job", str(job_file),
           "--address", f"127.0.0.1:{port}", "--metrics-port", "0", "--run-dir", str(state),
           "--port-file", str(port_file), *args]
    with open(log_path, "ab") as log:
        # A new session: Ctrl-C in the terminal reaches the launcher only, which then stops
        # each service in order (the trainer must checkpoint before the others go).
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                cwd=run_dir, start_new_session=True)
    return ServiceProcess(name, proc, state, log_path, port=port, args=tuple(args))


def sandbox_owner(run_dir: Path) -> str:
    """The sandbox service's owner, which names its sandboxes and whose leftovers it reaps at
    start: one per run directory, so that a resumed run reaps what its killed predecessor left
    while two runs on one machine never reap each other's live sandboxes."""
    return "run-" + hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:12]


def identity_of(name: str) -> str:
    """The certificate identity a local service process runs as: a teacher's is `teacher`
    (it may fetch a stage's weights and nothing else), as on a cluster."""
    return "teacher" if is_teacher(name) else component_of(name)


def component_of(name: str) -> str:
    """The service a local process runs: a teacher is a rollout deployment, as on a cluster."""
    if name.startswith(REPLICA_PREFIX):
        return "trainer"
    if is_teacher(name) or name.startswith(ROLLOUT_WORKER_PREFIX):
        return "rollout"
    return name.replace("_", "-")


def is_teacher(name: str) -> bool:
    """`teacher`, `teacher_1`, ...: the job's teachers (`kiln.api.distillation.teacher_process`)."""
    return name == TEACHER or name.startswith(TEACHER + "_")


def issue_certificates(run_dir: Path, job_name: str) -> None:
    """A fresh CA for this launch and a certificate per component under `run_dir/tls/`; the
    launcher (which drives the job, as the operator does on a cluster) takes the operator's."""
    from kiln.tls import issue_all

    folders = issue_all(run_dir / "tls", job_name)
    os.environ[TLS_DIR_ENV] = str(folders["operator"])


def wait_port(svc: ServiceProcess, timeout: float = 180.0) -> float:
    """Wait for the port file (the service is listening, not necessarily serving yet); returns
    the deadline's remainder as a monotonic time."""
    port_file = svc.state_dir / "ports.json"
    deadline = time.monotonic() + timeout
    while not port_file.exists():
        _check_alive(svc)
        if time.monotonic() > deadline:
            raise ServiceFailed(f"{svc.name} did not bind a port in {timeout:.0f} s:\n{svc.log_tail()}")
        time.sleep(0.05)
    info = json.loads(port_file.read_text())
    svc.port, svc.metrics_port = info["port"], info["metrics_port"]
    return deadline


def wait_ready(svc: ServiceProcess, timeout: float = 180.0) -> None:
    """Wait for the port file, then for the health service to say SERVING."""
    deadline = wait_port(svc, timeout)
    with channels.channel(svc.address, identity_of(svc.name)) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while True:
            _check_alive(svc)
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=2).status == \
                        health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise ServiceFailed(f"{svc.name} not healthy after {timeout:.0f} s:\n{svc.log_tail()}")
            time.sleep(0.2)


def _check_alive(svc: ServiceProcess) -> None:
    code = svc.proc.poll()
    if code is not None:
        raise ServiceFailed(f"{svc.name} exited with code {code}; last log lines:\n{svc.log_tail()}")


def restart(svc: ServiceProcess, job_file: Path, run_dir: Path, addresses: dict[str, str],
            extra_env: dict[str, str] | None = None) -> ServiceProcess:
    """Start a dead service again on its old port and wait until it is healthy."""
    kill_leftovers(svc)
    new = start(svc.name, job_file, run_dir, {k: v for k, v in addresses.items() if k != svc.name},
                extra_env, port=svc.port, args=svc.args)
    wait_ready(new)
    return new


def trainer_group(data_parallel: int) -> dict[str, dict[str, str]]:
    """The trainer's processes for `data_parallel` replicas, each with the environment that
    puts it in the world (replica 0 is `trainer`, the others `trainer-replica-N`); one
    process needs none."""
    if data_parallel == 1:
        return {"trainer": {}}
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    meet = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    return {("trainer" if r == 0 else f"{REPLICA_PREFIX}{r}"): {**meet, "KILN_TRAINER_REPLICA": str(r)}
            for r in range(data_parallel)}


def restart_group(group: dict[str, dict[str, str]], services: dict[str, ServiceProcess],
                  job_file: Path, run_dir: Path) -> None:
    """Restart the trainer's processes together: one rank's death breaks the world, and its
    ranks only become healthy once all of them have met again."""
    addrs = {n: s.address for n, s in services.items() if n not in group}
    for name in group:
        stop(services[name], timeout=30)
    for name, env in group.items():
        services[name] = start(name, job_file, run_dir, addrs, env, port=services[name].port)
    for name in group:
        wait_ready(services[name])


def stop(svc: ServiceProcess, timeout: float = 60.0) -> int | None:
    """SIGTERM (the service drains and runs its stop hook), SIGKILL if it does not exit."""
    terminate(svc.proc, timeout)
    kill_leftovers(svc)
    return svc.proc.returncode


def terminate(proc: subprocess.Popen, timeout: float) -> None:
    """SIGTERM, then SIGKILL if `proc` has not exited within `timeout` seconds."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def kill_leftovers(svc: ServiceProcess) -> None:
    """Kill what a dead service left in its session (each service has its own): a rollout
    killed with SIGKILL leaves vLLM's engine-core process behind, holding its memory."""
    try:
        os.killpg(svc.proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # nothing left
