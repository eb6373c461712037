"""Mutual TLS on the real service processes: a caller without a certificate of the job's CA is
refused before any RPC (plain text, TLS without a client certificate, a certificate of another
job's CA), and a caller with another component's certificate is refused PERMISSION_DENIED on the
RPCs not meant for it, such as the anonymous `SetPolicyVersion(2^64-1)` that used to make the
buffer drop everything. A service given neither certificates nor `--insecure` does not start."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from kiln.models.tiny import make_tiny_checkpoint
from kiln.protos.kiln.v1 import (buffer_pb2, buffer_pb2_grpc, env_pb2, env_pb2_grpc, trainer_pb2,
                                 trainer_pb2_grpc, weight_sync_pb2, weight_sync_pb2_grpc)
from kiln.control.channels import channel
from kiln.tls import issue_all, read_bundle

pytestmark = pytest.mark.slow

JOB = """
apiVersion: kiln.dev/v1alpha1
kind: RLJob
metadata: {name: mtls}
spec:
  model: {path: "%s", dtype: float32}
  tasks: [{name: t, env: chain, generate: {count: 4}}]
  stages: [{name: s, type: sft, tasks: [t], maxSteps: 1, batchSize: 2, microBatchSize: 2}]
"""


def _start(service: str, tmp: Path, job: Path, tls_dir: Path | None, extra=()) -> tuple[subprocess.Popen, int]:
    run = tmp / service
    run.mkdir(parents=True, exist_ok=True)
    ports = run / "ports.json"
    env = {k: v for k, v in os.environ.items() if k not in ("KILN_INSECURE", "KILN_TLS_DIR")}
    args = ["--tls-dir", str(tls_dir)] if tls_dir else []
    proc = subprocess.Popen(
        [sys.executable, "-m", f"kiln.services.{service}.main", "--job", str(job), "--run-dir", str(run),
         "--address", "127.0.0.1:0", "--metrics-port", "0", "--port-file", str(ports), *args, *extra],
        stdout=subprocess.DEVNULL, stderr=open(run / "log", "ab"), env=env)
    deadline = time.monotonic() + 120
    while not ports.exists():
        assert proc.poll() is None and time.monotonic() < deadline, (run / "log").read_text()[-2000:]
        time.sleep(0.1)
    return proc, json.loads(ports.read_text())["port"]


def _code(call) -> grpc.StatusCode | None:
    try:
        call()
        return None
    except grpc.RpcError as exc:
        return exc.code()


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("mtls")
    model = make_tiny_checkpoint(tmp / "model", hidden_size=64, intermediate_size=128)
    path = tmp / "job.yaml"
    path.write_text(JOB % model)
    issue_all(tmp / "tls", "mtls")
    issue_all(tmp / "other-tls", "another-job")
    return path, tmp


# service, the RPC (stub, method, request), a component allowed to make it, one that is not.
CASES = [
    ("buffer", buffer_pb2_grpc.BufferStub, "SetPolicyVersion",
     buffer_pb2.SetPolicyVersionRequest(policy_version=2**64 - 1), "trainer", "rollout"),
    ("buffer", buffer_pb2_grpc.BufferStub, "GetStatus", buffer_pb2.GetStatusRequest(), "operator", "sandbox"),
    ("weight_sync", weight_sync_pb2_grpc.WeightSyncStub, "Status", weight_sync_pb2.StatusRequest(),
     "operator", "buffer"),
    ("sandbox", env_pb2_grpc.EnvironmentStub, "ListTaskSets", env_pb2.ListTaskSetsRequest(), "rollout",
     "trainer"),
    ("trainer", trainer_pb2_grpc.TrainerStub, "GetTrainerStatus", trainer_pb2.TrainerStatusRequest(),
     "operator", "rollout"),
]


@pytest.mark.parametrize("service", sorted({c[0] for c in CASES}))
def test_only_the_right_component_gets_through(job, service: str) -> None:
    path, tmp = job
    component = service.replace("_", "-")
    proc, port = _start(service, tmp, path, tmp / "tls" / component)
    target = f"127.0.0.1:{port}"
    try:
        for svc, stub_class, method, request, allowed, refused in [c for c in CASES if c[0] == service]:
            def call(ch: grpc.Channel, method=method, request=request, stub_class=stub_class):
                with ch:
                    return getattr(stub_class(ch), method)(request, timeout=10)

            deadline = time.monotonic() + 120  # the service may still be building
            while _code(lambda: call(channel(target, component, bundle=read_bundle(tmp / "tls" / allowed)))) \
                    in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNIMPLEMENTED) \
                    and time.monotonic() < deadline:
                time.sleep(0.5)
            assert _code(lambda: call(channel(target, component,
                                              bundle=read_bundle(tmp / "tls" / allowed)))) is None, (method, allowed)
            assert _code(lambda: call(channel(target, component, bundle=read_bundle(tmp / "tls" / refused)))) \
                == grpc.StatusCode.PERMISSION_DENIED, (method, refused)
            # No certificate of this job: refused at the handshake, before any RPC.
            assert _code(lambda: call(grpc.insecure_channel(target))) == grpc.StatusCode.UNAVAILABLE
            ca_only = grpc.ssl_channel_credentials(root_certificates=read_bundle(tmp / "tls" / allowed).ca)
            assert _code(lambda: call(grpc.secure_channel(
                target, ca_only, options=[("grpc.ssl_target_name_override", f"kiln-{component}")]))) \
                == grpc.StatusCode.UNAVAILABLE
            assert _code(lambda: call(channel(target, component,
                                              bundle=read_bundle(tmp / "other-tls" / allowed)))) \
                == grpc.StatusCode.UNAVAILABLE
    finally:
        proc.terminate()
        proc.wait(60)
    if service == "buffer":
        # The trainer's SetPolicyVersion went through; the refused caller's did nothing more.
        assert "refused /kiln.v1.Buffer/SetPolicyVersion from rollout" in (tmp / "buffer" / "log").read_text()


def test_no_certificates_and_no_insecure_flag_means_no_start(job) -> None:
    path, tmp = job
    env = {k: v for k, v in os.environ.items() if k not in ("KILN_INSECURE", "KILN_TLS_DIR")}
    proc = subprocess.run([sys.executable, "-m", "kiln.services.buffer.main", "--job", str(path),
                           "--run-dir", str(tmp / "no-tls"), "--address", "127.0.0.1:0",
                           "--metrics-port", "0"], capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 2 and "no certificate folder: give --tls-dir" in proc.stderr
