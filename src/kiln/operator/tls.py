"""Each RLJob's certificates, kept in Secrets the operator makes, and the operator's own.

`ensure_certificates` gives a job a CA (Secret `<job>-ca`: `ca.crt`, `ca.key`; no pod mounts it)
and one TLS Secret per service component (`<job>-<component>-tls`: `ca.crt`, `tls.crt`,
`tls.key`, mounted at /etc/kiln/tls in that component's pods). They are made once and then
left alone (a certificate must outlive the reconcile that made it); a component Secret that is
missing or signed by another CA is issued again. The CA's fingerprint goes into the pods'
config hash, so pods restart onto a new CA if the CA Secret is ever replaced.

`Credentials` gives the operator's own clients (status reads, the stage driver) a certificate
with the `operator` identity for each job, issued in memory from that job's CA.

Secrets are not pure functions of the spec, unlike the other children (`children.py`): they
hold keys generated here.
"""
from __future__ import annotations

import base64
import hashlib
import threading
from typing import Any

from kiln.operator import naming
from kiln.operator.kube import Kube
from kiln.operator.naming import JobRef
from kiln.tls import Authority, Bundle, issue, new_authority

SERVICE_COMPONENTS = ("trainer", "rollout", "sandbox", "weight-sync", "buffer")


def ca_secret_name(job: JobRef) -> str:
    return job.child("ca")


def tls_secret_name(job: JobRef, component: str) -> str:
    return job.child(f"{component}-tls")


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _unb64(text: str) -> bytes:
    return base64.b64decode(text)


def fingerprint(ca_cert: bytes) -> str:
    return hashlib.sha256(ca_cert).hexdigest()[:16]


def _secret(job: JobRef, name: str, component: str, data: dict[str, bytes], image: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": naming.metadata(job, component, image, name=name),
            "data": {k: _b64(v) for k, v in data.items()}}


def read_authority(kube: Kube, job: JobRef) -> Authority | None:
    secret = kube.get("v1", "Secret", job.namespace, ca_secret_name(job))
    data = (secret or {}).get("data") or {}
    if "ca.crt" not in data or "ca.key" not in data:
        return None
    return Authority(_unb64(data["ca.crt"]), _unb64(data["ca.key"]))


def ensure_certificates(kube: Kube, job: JobRef, image: str) -> str:
    """Make whatever of the job's CA and component Secrets is missing; returns the CA's
    fingerprint."""
    ca = read_authority(kube, job)
    if ca is None:
        ca = new_authority(job.name)
        secret = _secret(job, ca_secret_name(job), "ca", {"ca.crt": ca.cert, "ca.key": ca.key}, image)
        kube.apply(secret)
    for component in SERVICE_COMPONENTS:
        name = tls_secret_name(job, component)
        current = ((kube.get("v1", "Secret", job.namespace, name) or {}).get("data") or {})
        if current.get("ca.crt") == _b64(ca.cert) and "tls.key" in current and "tls.crt" in current:
            continue
        bundle = issue(ca, component)
        kube.apply(_secret(job, name, component, {
            "ca.crt": bundle.ca, "tls.crt": bundle.cert, "tls.key": bundle.key}, image))
    return fingerprint(ca.cert)


class Credentials:
    """The operator's certificate for each job (issued once per job and CA, kept in memory)."""

    def __init__(self, kube: Kube) -> None:
        self.kube = kube
        self._cache: dict[str, tuple[bytes, Bundle]] = {}
        self._lock = threading.Lock()

    def __call__(self, job: JobRef) -> Bundle | None:
        """None while the job has no CA yet (its services do not run yet either)."""
        ca = read_authority(self.kube, job)
        if ca is None:
            return None
        with self._lock:
            cached = self._cache.get(job.uid)
            if cached is None or cached[0] != ca.cert:
                cached = self._cache[job.uid] = (ca.cert, issue(ca, "operator"))
            return cached[1]

    def forget(self, job: JobRef) -> None:
        with self._lock:
            self._cache.pop(job.uid, None)
