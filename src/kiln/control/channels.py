"""How one Kiln process opens a gRPC channel to another: the one set of channel options every
client and server uses, and mutual TLS with this process's certificate. A process without one
refuses to connect (`PlainTextRefused`) unless plain text was asked for (`--insecure`,
$KILN_INSECURE=1): a missing certificate folder is a deployment mistake, and quietly sending the
job's traffic unauthenticated would hide it.

The options are here, not in each client, because both ends must agree: a client that pings
more often than its server permits is sent GOAWAY, and a message larger than either end's limit
fails with RESOURCE_EXHAUSTED however the other end is set.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kiln.tls import INSECURE_ENV, TLS_DIR_ENV, Bundle, insecure_allowed, own_bundle, server_name

if TYPE_CHECKING:
    import grpc

# gRPC's defaults (4 MiB) are too small for trajectory and weight batches.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
#: Keepalive pings every 15 s, a peer silent for 10 s more is dead. Without them a call in
#: flight when the network drops packets (a partition, a node gone) waits out its whole
#: deadline and the connection is not replaced until TCP gives up, minutes later. Both ends
#: ping (a server learns of dead Subscribe streams), and accept pings that often even on an
#: idle connection: gRPC's defaults answer them with GOAWAY after two.
KEEPALIVE_OPTIONS = [
    ("grpc.keepalive_time_ms", 15_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    # GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS; its string lacks the "recv" (a
    # misspelt key is ignored silently, and the server then sends GOAWAY "too_many_pings").
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
]
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    *KEEPALIVE_OPTIONS,
]


class PlainTextRefused(ValueError):
    """No certificate to connect with, and plain text was not asked for."""


def _bundle_or_refuse(bundle: Bundle | None, component: str, target: str) -> Bundle | None:
    """The bundle to connect with; None where plain text was asked for."""
    bundle = bundle or own_bundle()
    if bundle is None and not insecure_allowed():
        raise PlainTextRefused(
            f"no certificate to connect to {component} at {target}: set ${TLS_DIR_ENV} to this "
            f"component's certificate folder (ca.crt, tls.crt, tls.key); ${INSECURE_ENV}=1 (or a "
            "service's --insecure) connects in plain text (debugging only)")
    return bundle


def _credentials(bundle: Bundle) -> "grpc.ChannelCredentials":
    import grpc

    return grpc.ssl_channel_credentials(root_certificates=bundle.ca, private_key=bundle.key,
                                        certificate_chain=bundle.cert)


def _tls_options(component: str, options) -> list[tuple[str, Any]]:
    return [*options, ("grpc.ssl_target_name_override", server_name(component))]


def channel(target: str, component: str, options=CHANNEL_OPTIONS,
            bundle: Bundle | None = None) -> "grpc.Channel":
    """A blocking channel to `component` at `target`: mutual TLS with this process's
    certificate (or `bundle`); plain text only where asked for, `PlainTextRefused` otherwise."""
    import grpc

    bundle = _bundle_or_refuse(bundle, component, target)
    if bundle is None:
        return grpc.insecure_channel(target, options=options)
    return grpc.secure_channel(target, _credentials(bundle), options=_tls_options(component, options))


def aio_channel(target: str, component: str, options=CHANNEL_OPTIONS,
                bundle: Bundle | None = None) -> "grpc.aio.Channel":
    """As `channel`, for asyncio code."""
    import grpc

    bundle = _bundle_or_refuse(bundle, component, target)
    if bundle is None:
        return grpc.aio.insecure_channel(target, options=options)
    return grpc.aio.secure_channel(target, _credentials(bundle),
                                   options=_tls_options(component, options))
