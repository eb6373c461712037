"""The service bootstrap, tested with a real server process and a real channel."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kiln.services.common.server import create_server

ECHO_SERVICE = Path(__file__).resolve().parents[1] / "helpers" / "echo_service.py"


def _wait_for(path: Path, timeout: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            return json.loads(path.read_text())
        time.sleep(0.05)
    raise TimeoutError(f"{path} did not appear")


def _health(channel: grpc.Channel, service: str = "") -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status


@pytest.fixture
def echo_process(tmp_path):
    ports = tmp_path / "ports.json"
    proc = subprocess.Popen(
        [sys.executable, str(ECHO_SERVICE), "--address", "127.0.0.1:0",
         "--metrics-port", "0", "--port-file", str(ports), "--run-dir", str(tmp_path),
         "--build-seconds", "1.5"],
        stderr=subprocess.PIPE, text=True, env={**os.environ, "KILN_LOG_FORMAT": "json", "KILN_LOG_LEVEL": "DEBUG"})
    try:
        info = _wait_for(ports)
        yield proc, info, tmp_path
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_readiness_rpc_metrics_and_graceful_stop(echo_process):
    proc, info, run_dir = echo_process
    channel = grpc.insecure_channel(f"127.0.0.1:{info['port']}")
    # Bound and answering, but not ready while the build runs.
    assert _health(channel) == health_pb2.HealthCheckResponse.NOT_SERVING
    # Its methods meanwhile answer UNAVAILABLE, which clients retry (UNIMPLEMENTED they would not).
    with pytest.raises(grpc.RpcError) as starting:
        channel.unary_unary("/kiln.test.Echo/Echo")(b"early", timeout=5)
    assert starting.value.code() == grpc.StatusCode.UNAVAILABLE, starting.value
    deadline = time.monotonic() + 20
    while _health(channel) != health_pb2.HealthCheckResponse.SERVING:
        assert time.monotonic() < deadline, "never became SERVING"
        time.sleep(0.1)
    assert _health(channel, "kiln.test.Echo") == health_pb2.HealthCheckResponse.SERVING

    echo = channel.unary_unary("/kiln.test.Echo/Echo")
    reply, call = echo.with_call(b"hi", metadata=(("x-request-id", "req-42"),), timeout=5)
    assert reply == b"echo:hi"
    assert ("x-request-id", "req-42") in call.trailing_metadata()
    with pytest.raises(grpc.RpcError) as err:
        echo(b"fail", timeout=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as missing:
        channel.unary_unary("/kiln.test.Echo/Nope")(b"x", timeout=5)
    assert missing.value.code() == grpc.StatusCode.UNIMPLEMENTED

    # Reflection lists the standard services.
    refl = reflection_pb2_grpc.ServerReflectionStub(channel)
    resp = next(refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
    names = {s.name for s in resp.list_services_response.service}
    assert "grpc.health.v1.Health" in names

    body = urllib.request.urlopen(f"http://127.0.0.1:{info['metrics_port']}/metrics", timeout=5).read().decode()
    assert 'kiln_rpc_requests_total{code="OK",method="/kiln.test.Echo/Echo"} 1.0' in body
    assert 'kiln_rpc_requests_total{code="INVALID_ARGUMENT",method="/kiln.test.Echo/Echo"} 1.0' in body
    assert 'kiln_service_up{service="echo"} 1.0' in body

    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=20) == 0
    assert (run_dir / "stopped").read_text() == "clean"
    logs = [json.loads(line) for line in proc.stderr.read().splitlines() if line.startswith("{")]
    access = [entry for entry in logs if entry.get("method") == "/kiln.test.Echo/Echo"]
    assert any(entry.get("request_id") == "req-42" and entry["code"] == "OK" for entry in access)
    channel.close()


def test_bad_job_file_exits_with_clear_message(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text("apiVersion: kiln.dev/v1alpha1\nkind: RLJob\nmetadata: {name: x}\nspec: {}\n")
    res = subprocess.run([sys.executable, str(ECHO_SERVICE), "--job", str(job),
                          "--address", "127.0.0.1:0", "--metrics-port", "0"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2
    assert "spec.model: required field is missing" in res.stderr
    assert "Traceback" not in res.stderr


async def test_create_server_binds_a_free_port():
    server, port = await create_server("127.0.0.1:0")
    try:
        assert port > 0
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            resp = await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        await server.stop(0)
