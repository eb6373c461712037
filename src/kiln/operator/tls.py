"""Each RLJob's certificates, kept in Secrets the operator makes and renews, and the operator's own.

`ensure_certificates` gives a job a CA (Secret `<job>-ca`; no pod mounts it) and one TLS Secret
per service component (`<job>-<component>-tls`: `ca.crt`, `tls.crt`, `tls.key`, mounted at
/etc/kiln/tls in that component's pods). It runs on every reconcile and drift repair, and:

- issues a component certificate that is missing, not signed by the job's signing CA, or past
  two thirds of its lifetime (`kiln.tls.renewal_time`);
- rotates the CA with overlap. A CA past two thirds of its life gets a successor (`next.crt`),
  which joins the trust bundle (`ca.crt` of every Secret) while certificates are still signed by
  the old CA; after `overlap` the successor becomes the signing CA and every certificate is
  issued again from it, and the old CA stays in the bundle until it expires (a pod not yet
  restarted still presents a certificate it signed, which can live no longer than it).

Services read their certificate once, at start. A renewal therefore rolls the job's pods: the
returned fingerprint (of the trust bundle and every component certificate) joins each pod's
config hash. That is one restart per renewal (every `CERT_LIFETIME * 2/3`, all components at
once), and three per CA rotation (bundle out, certificates reissued, old CA dropped); a
restart is something every Kiln service survives (the trainer resumes from its checkpoint).
Reloading credentials in place would avoid it only for servers: gRPC clients keep the
credentials their channel was made with. The overlap must outlast one roll of the job's pods.

`Credentials` gives the operator's own clients (status reads, the stage driver) a certificate
with the `operator` identity for each job, issued in memory from the job's signing CA and
renewed like the others.

Secrets are not pure functions of the spec, unlike the other children (`children.py`): they
hold keys generated here.
"""
from __future__ import annotations

import base64
import datetime
import hashlib
import threading
from dataclasses import dataclass
from typing import Any

from kiln.operator import naming
from kiln.operator.kube import Kube
from kiln.operator.naming import JobRef
from kiln.tls import (CA_LIFETIME, CERT_LIFETIME, Authority, Bundle, due, issue, issuer_of,
                      new_authority, split_bundle, validity)

# The services' identities; `teacher` is the frozen deployments' (`frozen.py`).
SERVICE_COMPONENTS = ("trainer", "rollout", "sandbox", "weight-sync", "buffer", "teacher")
_SINCE = "next.since"


@dataclass(frozen=True)
class Lifetimes:
    """How long the operator's certificates live (`OperatorConfig`)."""

    cert: datetime.timedelta = CERT_LIFETIME
    ca: datetime.timedelta = CA_LIFETIME
    overlap: datetime.timedelta = datetime.timedelta(hours=24)
    """How long a new CA is trusted before it signs: time for every pod to restart with the
    bundle that holds it."""


_lifetimes = Lifetimes()


def set_lifetimes(lifetimes: Lifetimes) -> None:
    """The operator's settings, once at startup."""
    global _lifetimes
    _lifetimes = lifetimes


def ca_secret_name(job: JobRef) -> str:
    return job.child("ca")


def tls_secret_name(job: JobRef, component: str) -> str:
    return job.child(f"{component}-tls")


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _unb64(text: str) -> bytes:
    return base64.b64decode(text)


def fingerprint(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def _secret(job: JobRef, name: str, component: str, data: dict[str, bytes], image: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": naming.metadata(job, component, image, name=name),
            "data": {k: _b64(v) for k, v in data.items()}}


@dataclass(frozen=True)
class CaState:
    """The job's CA Secret: the signing CA, its successor during a rotation (and since when),
    and the trust bundle."""

    signing: Authority
    trust: bytes
    next: Authority | None = None
    since: datetime.datetime | None = None

    def data(self) -> dict[str, bytes]:
        # Every key always, empty when there is no successor: an apply then never depends on
        # the server dropping keys the manifest no longer has.
        nxt = self.next or Authority(b"", b"")
        return {"ca.crt": self.signing.cert, "ca.key": self.signing.key, "trust.crt": self.trust,
                "next.crt": nxt.cert, "next.key": nxt.key,
                _SINCE: self.since.isoformat().encode() if self.since else b""}


def read_state(kube: Kube, job: JobRef) -> CaState | None:
    secret = kube.get("v1", "Secret", job.namespace, ca_secret_name(job))
    data = {k: _unb64(v) for k, v in ((secret or {}).get("data") or {}).items()}
    if "ca.crt" not in data or "ca.key" not in data:
        return None
    signing = Authority(data["ca.crt"], data["ca.key"])
    if data.get("next.crt") and data.get("next.key") and data.get(_SINCE):
        return CaState(signing, data.get("trust.crt", signing.cert),
                       Authority(data["next.crt"], data["next.key"]),
                       datetime.datetime.fromisoformat(data[_SINCE].decode()))
    return CaState(signing, data.get("trust.crt", signing.cert))


def read_authority(kube: Kube, job: JobRef) -> Authority | None:
    state = read_state(kube, job)
    return state.signing if state else None


def _bundle(*cas: bytes, now: datetime.datetime) -> bytes:
    """The CA certificates still valid at `now`, each once, in order."""
    out: list[bytes] = []
    for ca in cas:
        if ca not in out and validity(ca)[1] > now:
            out.append(ca)
    return b"".join(out)


def advance(state: CaState | None, job: JobRef, lifetimes: Lifetimes,
            now: datetime.datetime) -> CaState:
    """The CA state one step on: made, rotation started, successor promoted, expired CAs
    dropped from the bundle."""
    if state is None:
        ca = new_authority(job.name, lifetimes.ca, now)
        return CaState(ca, ca.cert)
    signing, nxt, since = state.signing, state.next, state.since
    old = split_bundle(state.trust)
    if nxt is None and due(signing.cert, now):
        nxt, since = new_authority(job.name, lifetimes.ca, now), now
    if nxt is not None and since is not None and now >= since + lifetimes.overlap:
        signing, nxt, since = nxt, None, None
    cas = [signing.cert, *([nxt.cert] if nxt else []), *old]
    return CaState(signing, _bundle(*cas, now=now), nxt, since)


def _needs_issue(current: dict[str, str], state: CaState, now: datetime.datetime) -> bool:
    if "tls.crt" not in current or "tls.key" not in current:
        return True
    cert = _unb64(current["tls.crt"])
    return issuer_of(cert, [state.signing.cert]) is None or due(cert, now)


def ensure_certificates(kube: Kube, job: JobRef, image: str, *,
                        now: datetime.datetime | None = None,
                        lifetimes: Lifetimes | None = None) -> str:
    """Make, renew and rotate the job's CA and component Secrets as due; returns the
    fingerprint of what the pods mount (it changes whenever they must restart)."""
    now, lifetimes = now or _now(), lifetimes or _lifetimes
    before = read_state(kube, job)
    state = advance(before, job, lifetimes, now)
    if state != before:
        kube.apply(_secret(job, ca_secret_name(job), "ca", state.data(), image))
    mounted = [state.trust]
    for component in SERVICE_COMPONENTS:
        name = tls_secret_name(job, component)
        current = ((kube.get("v1", "Secret", job.namespace, name) or {}).get("data") or {})
        if _needs_issue(current, state, now):
            bundle = issue(state.signing, component, lifetimes.cert, trust=state.trust, now=now)
        else:
            bundle = Bundle(state.trust, _unb64(current["tls.crt"]), _unb64(current["tls.key"]))
        data = {"ca.crt": bundle.ca, "tls.crt": bundle.cert, "tls.key": bundle.key}
        if current != {k: _b64(v) for k, v in data.items()}:
            kube.apply(_secret(job, name, component, data, image))
        mounted.append(bundle.cert)
    return fingerprint(b"".join(mounted))


class Credentials:
    """The operator's certificate for each job (issued per job and signing CA, kept in memory,
    renewed when due)."""

    def __init__(self, kube: Kube) -> None:
        self.kube = kube
        self._cache: dict[str, tuple[CaState, Bundle]] = {}
        self._lock = threading.Lock()

    def __call__(self, job: JobRef) -> Bundle | None:
        """None while the job has no CA yet (its services do not run yet either)."""
        state = read_state(self.kube, job)
        if state is None:
            return None
        with self._lock:
            cached = self._cache.get(job.uid)
            if cached is None or cached[0] != state or due(cached[1].cert):
                cached = self._cache[job.uid] = (state, issue(state.signing, "operator",
                                                              _lifetimes.cert, trust=state.trust))
            return cached[1]

    def forget(self, job: JobRef) -> None:
        with self._lock:
            self._cache.pop(job.uid, None)
