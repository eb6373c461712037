"""One Kiln service as a real process (`python -m kiln.services.X.main`) on a loopback port:
start it, wait for it, stop it as the launcher does (SIGTERM)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from kiln.services.trainer.client import TrainerClient


def start_service(service: str, run_dir: Path, job: Path, env: dict[str, str] | None = None,
                  extra: list[str] = ()) -> tuple[subprocess.Popen, dict]:
    run_dir.mkdir(parents=True, exist_ok=True)
    ports = run_dir / "ports.json"
    ports.unlink(missing_ok=True)
    log = run_dir / f"{service}.log"  # a file, not a pipe nobody drains while the test runs
    proc = subprocess.Popen(
        [sys.executable, "-m", f"kiln.services.{service}.main", "--job", str(job),
         "--run-dir", str(run_dir), "--address", "127.0.0.1:0", "--metrics-port", "0",
         "--port-file", str(ports), *extra],
        stdout=subprocess.DEVNULL, stderr=log.open("a"), env={**os.environ, **(env or {})})
    deadline = time.monotonic() + 90
    while not ports.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"{service} did not bind: {log.read_text()[-3000:]}")
        time.sleep(0.1)
    return proc, json.loads(ports.read_text())


def stop_service(proc: subprocess.Popen) -> int:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()


def wait_for(what: str, fn, timeout: float = 90.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = fn()
        if got:
            return got
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def trainer_serving(trainer: TrainerClient) -> bool:
    import grpc

    try:
        trainer.status()
        return True
    except grpc.RpcError:
        return False
