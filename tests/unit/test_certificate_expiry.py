"""The expiry of the certificate a service serves with is exported under its component's name.

The renewal alert (`KilnCertificateExpiresSoon`, tested with promtool in the chart tests) reads
`kiln_certificate_expiry_timestamp_seconds{component=...}`; these tests pin what the servers
put in that series: the component that serves, and when its certificate expires.
"""
from __future__ import annotations

import datetime

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
import pytest
from prometheus_client import REGISTRY

from kiln.services.common.metrics import CERTIFICATE_EXPIRY
from kiln.services.common.tls import server_credentials
from kiln.tls import Bundle, issue, new_authority

SERIES = "kiln_certificate_expiry_timestamp_seconds"
NOW = datetime.datetime(2026, 3, 1, tzinfo=datetime.timezone.utc)


@pytest.fixture(autouse=True)
def _no_earlier_series():
    # The registry is the process's: servers started by other tests have set series already.
    CERTIFICATE_EXPIRY.clear()


def _expiry(component: str) -> float | None:
    return REGISTRY.get_sample_value(SERIES, {"component": component})


def test_each_server_exports_its_own_certificates_expiry_under_its_component() -> None:
    ca = new_authority("expiry", now=NOW)
    buffer = issue(ca, "buffer", datetime.timedelta(days=30), now=NOW)
    trainer = issue(ca, "trainer", datetime.timedelta(days=60), now=NOW)
    server_credentials(buffer)
    server_credentials(trainer)
    assert _expiry("buffer") == (NOW + datetime.timedelta(days=30)).timestamp()
    assert _expiry("trainer") == (NOW + datetime.timedelta(days=60)).timestamp()


def test_a_certificate_without_a_common_name_is_exported_with_an_empty_component() -> None:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(x509.NameOID.ORGANIZATION_NAME, "kiln")])
    expires = NOW + datetime.timedelta(days=7)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(NOW).not_valid_after(expires).sign(key, hashes.SHA256()))
    pem = cert.public_bytes(serialization.Encoding.PEM)
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    server_credentials(Bundle(ca=pem, cert=pem, key=key_pem))
    assert _expiry("") == expires.timestamp()
