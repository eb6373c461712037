"""Certificates that live: the operator renews a job's certificates at two thirds of their
lifetime and rotates its CA with overlap (`kiln.operator.tls`, against the fake Kubernetes API:
no API server can run here; the operator's client is real), and over real mutual TLS on
loopback a renewed bundle and a rotating CA keep calls working while an expired certificate is
refused and a client without certificates will not fall back to plain text."""
from __future__ import annotations

import asyncio
import base64
import datetime
from pathlib import Path
from typing import Iterator

import grpc
import kubernetes
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kiln.cli.devcluster.api import running_fake_api, write_kubeconfig
from kiln.control.channels import PlainTextRefused, aio_channel, channel
from kiln.operator.kube import Kube
from kiln.operator.children import desired_children
from kiln.operator.naming import CONFIG_HASH, JobRef
from kiln.operator.tls import (SERVICE_COMPONENTS, Lifetimes, ensure_certificates, read_state,
                               tls_secret_name)
from kiln.services.common.server import start_server
from kiln.tls import INSECURE_ENV, issue, issuer_of, new_authority, split_bundle, validity

from helpers.operator_jobs import SMALL, spec

T0 = datetime.datetime(2030, 1, 1, tzinfo=datetime.timezone.utc)
HOUR = datetime.timedelta(hours=1)
# Short lives, so that renewal and rotation happen within one test's clock.
SHORT = Lifetimes(cert=3 * HOUR, ca=30 * HOUR, overlap=HOUR)


@pytest.fixture(scope="module")
def kube(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Kube]:
    with running_fake_api() as (fake, url):
        fake.add_namespace("certs")
        kubeconfig = write_kubeconfig(tmp_path_factory.mktemp("kc") / "kubeconfig", url, "certs")
        yield Kube(kubernetes.config.new_client_from_config(str(kubeconfig)))


def _mounted(kube: Kube, job: JobRef, component: str) -> dict[str, bytes]:
    data = kube.get("v1", "Secret", job.namespace, tls_secret_name(job, component))["data"]
    return {k: base64.b64decode(v) for k, v in data.items()}


def _config_hashes(job: JobRef, fingerprint: str) -> dict[str, str]:
    hashes = {o["metadata"]["name"]: o["spec"]["template"]["metadata"]["annotations"][CONFIG_HASH]
              for o in desired_children(job, spec(SMALL), ca_fingerprint=fingerprint)
              if o["kind"] in ("Deployment", "StatefulSet")}
    assert len(hashes) == 5
    return hashes


def test_certificates_are_renewed_at_two_thirds_of_their_lifetime(kube: Kube) -> None:
    job = JobRef("renew", "certs", "uid-renew")
    first = ensure_certificates(kube, job, "img", now=T0, lifetimes=SHORT)
    issued = {c: _mounted(kube, job, c)["tls.crt"] for c in SERVICE_COMPONENTS}
    start, end = validity(issued["trainer"])
    assert end - start == SHORT.cert + datetime.timedelta(minutes=5)  # backdated for clock skew
    # Before two thirds of the lifetime: nothing changes, so no pod restarts.
    assert ensure_certificates(kube, job, "img", now=T0 + HOUR, lifetimes=SHORT) == first
    assert {c: _mounted(kube, job, c)["tls.crt"] for c in SERVICE_COMPONENTS} == issued
    # Past it: every certificate is issued again, by the same CA, and the pods are rolled.
    renewed = ensure_certificates(kube, job, "img", now=T0 + 2 * HOUR, lifetimes=SHORT)
    assert renewed != first
    before, after = _config_hashes(job, first), _config_hashes(job, renewed)
    assert all(before[k] != after[k] for k in before)  # every workload rolls onto them
    ca = read_state(kube, job).signing.cert
    for c in SERVICE_COMPONENTS:
        cert = _mounted(kube, job, c)["tls.crt"]
        assert cert != issued[c] and issuer_of(cert, [ca]) == ca
        assert validity(cert)[1] > T0 + 4 * HOUR


def test_the_ca_rotates_with_overlap(kube: Kube) -> None:
    job = JobRef("rotate", "certs", "uid-rotate")
    ensure_certificates(kube, job, "img", now=T0, lifetimes=SHORT)
    old = read_state(kube, job).signing.cert
    # Two thirds into the CA's life: its successor is trusted everywhere, but does not sign yet.
    at = T0 + 21 * HOUR
    ensure_certificates(kube, job, "img", now=at, lifetimes=SHORT)
    state = read_state(kube, job)
    new = state.next.cert
    for c in SERVICE_COMPONENTS:
        mounted = _mounted(kube, job, c)
        assert split_bundle(mounted["ca.crt"]) == [old, new]
        assert issuer_of(mounted["tls.crt"], [old, new]) == old
    # After the overlap the successor signs; the old CA stays trusted until it expires.
    ensure_certificates(kube, job, "img", now=at + SHORT.overlap, lifetimes=SHORT)
    assert read_state(kube, job).signing.cert == new and read_state(kube, job).next is None
    for c in SERVICE_COMPONENTS:
        mounted = _mounted(kube, job, c)
        assert split_bundle(mounted["ca.crt"]) == [new, old]
        assert issuer_of(mounted["tls.crt"], [old, new]) == new
    ensure_certificates(kube, job, "img", now=T0 + 31 * HOUR, lifetimes=SHORT)
    assert split_bundle(_mounted(kube, job, "trainer")["ca.crt"]) == [new]


async def _health(server_bundle, client_bundle, component: str = "buffer") -> grpc.StatusCode:
    served = await start_server("127.0.0.1:0", [], tls=server_bundle)
    try:
        async with aio_channel(f"127.0.0.1:{served.port}", component, bundle=client_bundle) as ch:
            try:
                await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
            except grpc.aio.AioRpcError as exc:
                return exc.code()
            return grpc.StatusCode.OK
    finally:
        await served.server.stop(0)


def test_during_a_rotation_old_and_new_certificates_reach_each_other() -> None:
    old, new = new_authority("rot"), new_authority("rot")
    trust = old.cert + new.cert
    assert asyncio.run(_health(issue(old, "buffer", trust=trust),
                               issue(new, "trainer", trust=trust))) == grpc.StatusCode.OK
    assert asyncio.run(_health(issue(new, "buffer", trust=trust),
                               issue(old, "trainer", trust=trust))) == grpc.StatusCode.OK
    # Without the overlap, a server that trusts only the old CA refuses a new certificate.
    assert asyncio.run(_health(issue(old, "buffer"),
                               issue(new, "trainer", trust=trust))) == grpc.StatusCode.UNAVAILABLE


def test_an_expired_certificate_is_refused_either_way() -> None:
    ca = new_authority("exp")
    past = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(days=2)
    expired = {c: issue(ca, c, datetime.timedelta(days=1), now=past) for c in ("buffer", "trainer")}
    fresh = {c: issue(ca, c) for c in ("buffer", "trainer")}
    assert asyncio.run(_health(fresh["buffer"], fresh["trainer"])) == grpc.StatusCode.OK
    assert asyncio.run(_health(fresh["buffer"], expired["trainer"])) == grpc.StatusCode.UNAVAILABLE
    assert asyncio.run(_health(expired["buffer"], fresh["trainer"])) == grpc.StatusCode.UNAVAILABLE


def test_a_client_without_certificates_refuses_plain_text(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.delenv("KILN_TLS_DIR", raising=False)
    monkeypatch.delenv(INSECURE_ENV, raising=False)
    with pytest.raises(PlainTextRefused, match="no certificate to connect to buffer"):
        channel("127.0.0.1:1", "buffer")
    with pytest.raises(PlainTextRefused, match="KILN_INSECURE"):
        aio_channel("127.0.0.1:1", "trainer")
    monkeypatch.setenv(INSECURE_ENV, "1")  # asked for explicitly: plain text
    channel("127.0.0.1:1", "buffer").close()
