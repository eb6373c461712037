"""Certificates of a job's services: one CA per job, one certificate per component.

Every Kiln service serves gRPC over mutual TLS. A job has its own CA (made by `kiln run` for a
local run, by the operator for an applied RLJob); each component gets a certificate whose
common name is the component (`trainer`, `rollout`, `sandbox`, `weight-sync`, `buffer`,
`teacher` for the job's frozen deployments -- teachers, references, judges, outcome models,
subagents -- and `operator` for whoever drives the job), which is what servers authorize calls by
(`kiln.services.common.tls`). The certificate's DNS name is `kiln-<component>`: clients verify
the server against the component they mean to reach, whatever address it has (loopback, a
Service, a pod IP behind a headless Service).

A TLS folder holds `ca.crt`, `tls.crt` and `tls.key` (the names Kubernetes TLS Secrets use), the
key readable by its owner only. `ca.crt` is the trust bundle: the job's CA, and during a CA
rotation the old and the new one together (`kiln.operator.tls`). A process finds its own in
`$KILN_TLS_DIR` (`own_bundle`); `kiln.control.channels` connects with it, and refuses to connect
without one unless plain text was asked for (`insecure_allowed`).

Certificates live `CERT_LIFETIME` (never past their CA) and are due for renewal at two thirds
of their lifetime (`renewal_time`), so a missed renewal leaves a third of the lifetime to act on
the alert before calls fail.
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from pathlib import Path
TLS_DIR_ENV = "KILN_TLS_DIR"
INSECURE_ENV = "KILN_INSECURE"
COMPONENTS = ("trainer", "rollout", "sandbox", "weight-sync", "buffer", "operator", "teacher")
CA_FILE, CERT_FILE, KEY_FILE = "ca.crt", "tls.crt", "tls.key"
CERT_LIFETIME = datetime.timedelta(days=90)
CA_LIFETIME = datetime.timedelta(days=730)
RENEW_FRACTION = 2 / 3
"""A certificate is renewed once this fraction of its lifetime has passed."""
# Clocks of the machines in a job may differ by a little: a certificate is valid from just before
# it is made.
_BACKDATE = datetime.timedelta(minutes=5)


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def server_name(component: str) -> str:
    """The DNS name in `component`'s certificate, which its clients verify."""
    return f"kiln-{component}"


@dataclass(frozen=True)
class Bundle:
    """PEM bytes: the job's CA certificate, and one component's certificate and key."""

    ca: bytes
    cert: bytes
    key: bytes


@dataclass(frozen=True)
class Authority:
    """A job's CA: its certificate and key (PEM)."""

    cert: bytes
    key: bytes


def _key():
    from cryptography.hazmat.primitives.asymmetric import ec

    # P-256: small keys, fast handshakes, supported by every gRPC TLS stack.
    return ec.generate_private_key(ec.SECP256R1())


def _pem_key(key) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def new_authority(job: str, lifetime: datetime.timedelta = CA_LIFETIME,
                  now: datetime.datetime | None = None) -> Authority:
    """A fresh CA for job `job`, valid for `lifetime` from `now`."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.x509.oid import NameOID

    key = _key()
    # Two CAs of one job are in one trust bundle during a rotation: names must tell them apart.
    serial = x509.random_serial_number()
    name = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "kiln"),
                      x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, f"{serial:x}"[:16]),
                      x509.NameAttribute(NameOID.COMMON_NAME, f"kiln job {job} CA"[:64])])
    now = now or _now()
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(serial)
            .not_valid_before(now - _BACKDATE).not_valid_after(now + lifetime)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False,
                                         encipher_only=False, decipher_only=False), critical=True)
            .sign(key, hashes.SHA256()))
    return Authority(cert.public_bytes(serialization.Encoding.PEM), _pem_key(key))


def issue(ca: Authority, component: str, lifetime: datetime.timedelta = CERT_LIFETIME, *,
          trust: bytes | None = None, now: datetime.datetime | None = None) -> Bundle:
    """A certificate for `component`, usable as server and as client, signed by `ca`, valid for
    `lifetime` from `now` but not past the CA. `trust`: the bundle's CA certificates (default:
    `ca`'s alone)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    if component not in COMPONENTS:
        raise ValueError(f"component {component!r} is not one of {COMPONENTS}")
    ca_cert = x509.load_pem_x509_certificate(ca.cert)
    ca_key = serialization.load_pem_private_key(ca.key, password=None)
    key = _key()
    now = now or _now()
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "kiln"),
                                     x509.NameAttribute(NameOID.COMMON_NAME, component)]))
            .issuer_name(ca_cert.subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - _BACKDATE)
            .not_valid_after(min(now + lifetime, ca_cert.not_valid_after_utc))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(server_name(component))]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                  ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    return Bundle(trust or ca.cert, cert.public_bytes(serialization.Encoding.PEM), _pem_key(key))


# ------------------------------------------------------------------ lifetimes


def validity(cert_pem: bytes) -> tuple[datetime.datetime, datetime.datetime]:
    """(not before, not after) of the first certificate in `cert_pem`, in UTC."""
    from cryptography import x509

    cert = x509.load_pem_x509_certificate(cert_pem)
    return cert.not_valid_before_utc, cert.not_valid_after_utc


def renewal_time(cert_pem: bytes) -> datetime.datetime:
    """When the certificate is due for renewal: two thirds into its lifetime."""
    start, end = validity(cert_pem)
    return start + (end - start) * RENEW_FRACTION


def due(cert_pem: bytes, now: datetime.datetime | None = None) -> bool:
    return (now or _now()) >= renewal_time(cert_pem)


def split_bundle(pem: bytes) -> list[bytes]:
    """The PEM certificates of a trust bundle, one each."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    return [c.public_bytes(serialization.Encoding.PEM) for c in x509.load_pem_x509_certificates(pem)]


def issuer_of(cert_pem: bytes, cas: list[bytes]) -> bytes | None:
    """The one of `cas` (PEM) that signed `cert_pem`, None if none did."""
    from cryptography import x509
    from cryptography.exceptions import InvalidSignature

    cert = x509.load_pem_x509_certificate(cert_pem)
    for ca in cas:
        try:
            cert.verify_directly_issued_by(x509.load_pem_x509_certificate(ca))
        except (ValueError, TypeError, InvalidSignature):
            continue
        return ca
    return None


def write_bundle(folder: Path, bundle: Bundle) -> Path:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / CA_FILE).write_bytes(bundle.ca)
    (folder / CERT_FILE).write_bytes(bundle.cert)
    key = folder / KEY_FILE
    key.touch(mode=0o600)
    os.chmod(key, 0o600)
    key.write_bytes(bundle.key)
    return folder


def read_bundle(folder: Path) -> Bundle:
    """The bundle in `folder`; ValueError naming the missing file."""
    folder = Path(folder)
    parts = []
    for name in (CA_FILE, CERT_FILE, KEY_FILE):
        try:
            parts.append((folder / name).read_bytes())
        except OSError as exc:
            raise ValueError(f"TLS folder {folder}: cannot read {name} ({exc.strerror})") from None
    return Bundle(*parts)


def issue_all(folder: Path, job: str) -> dict[str, Path]:
    """A new CA and a certificate folder per component under `folder` (`kiln run`):
    `folder/<component>/`. The CA key is not kept: nothing is issued later, and nothing renews
    them (every launch makes new ones), so they last a year rather than `CERT_LIFETIME`."""
    ca = new_authority(job)
    return {c: write_bundle(Path(folder) / c, issue(ca, c, datetime.timedelta(days=365)))
            for c in COMPONENTS}


# ------------------------------------------------------------------ this process's certificate


def insecure_allowed() -> bool:
    """Whether plain text was asked for ($KILN_INSECURE=1, which a service's `--insecure`
    sets): without it, a process with no certificate folder refuses to connect."""
    return os.environ.get(INSECURE_ENV) == "1"


def own_bundle(tls_dir: str | Path | None = None) -> Bundle | None:
    """This process's certificate bundle: `tls_dir`, else $KILN_TLS_DIR, else None."""
    folder = tls_dir or os.environ.get(TLS_DIR_ENV)
    return read_bundle(Path(folder)) if folder else None
