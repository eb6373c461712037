"""Mutual TLS on every Kiln gRPC server, and who may call what (clients: `kiln.tls`).

A process finds its certificate folder (`ca.crt`, `tls.crt`, `tls.key`; see `kiln.tls`) in
`--tls-dir` or `$KILN_TLS_DIR`. Servers then accept only clients whose certificate the job's CA
signed (a client without one fails the TLS handshake: gRPC Python cannot ask for a client
certificate without requiring it, so no RPC happens that could answer UNAUTHENTICATED), and
`AuthorizationInterceptor` lets each RPC through only for the components `CALLERS` names
(PERMISSION_DENIED otherwise; a method missing from the table is denied). Clients verify the
server as the component they meant to reach (`kiln-<component>`, whatever its address).

Without a certificate folder a server refuses to start unless told `--insecure` (or
`KILN_INSECURE=1`), which it logs as a warning; clients of such a process connect in plain text,
and a client without a certificate refuses to connect otherwise (`kiln.control.channels`).
"""
from __future__ import annotations

import logging
from typing import Awaitable, Callable

import grpc
from cryptography import x509

from kiln.services.common.interceptors import rewrap
from kiln.services.common.metrics import CERTIFICATE_EXPIRY
from kiln.services.common.ratelimit import LogLimiter
from kiln.tls import INSECURE_ENV, Bundle  # noqa: F401 (the services' name for it)

log = logging.getLogger("kiln.tls")
_REFUSALS = LogLimiter(burst=5, period_s=60)

ANY = "*"

# Full method name -> the components that may call it. "*": any caller holding a certificate of
# the job (health checks and reflection).
CALLERS: dict[str, frozenset[str]] = {
    **{f"/kiln.v1.Buffer/{m}": frozenset({"trainer"})
       for m in ("GetBatch", "AckBatch", "SetPolicyVersion", "Configure")},
    "/kiln.v1.Buffer/Put": frozenset({"rollout"}),
    "/kiln.v1.Buffer/GetStatus": frozenset({"operator", "trainer", "rollout"}),
    **{f"/kiln.v1.Environment/{m}": frozenset({"rollout"})
       for m in ("ListTaskSets", "OpenEpisode", "OpenSubtask", "Step", "CloseEpisode", "Demonstrate")},
    **{f"/kiln.v1.Sandbox/{m}": frozenset({"rollout"})
       for m in ("CreateSession", "Exec", "ReadFile", "WriteFile", "Verify", "DestroySession")},
    **{f"/kiln.v1.Rollout/{m}": frozenset({"operator"}) for m in ("SetMode", "Evaluate", "GetStatus")},
    # A student's rollout asks a teacher's (a rollout deployment of its own) to score.
    "/kiln.v1.Rollout/Score": frozenset({"rollout", "operator"}),
    # A swarm's orchestrator (on the rollout service) samples its frozen subagents' turns.
    "/kiln.v1.Rollout/Generate": frozenset({"rollout", "operator"}),
    # The stage driver (the operator's, or `kiln run`'s under the operator's certificate): it
    # also holds a stage at a held-out evaluation and rolls it back to its best checkpoint.
    **{f"/kiln.v1.Trainer/{m}": frozenset({"operator"})
       for m in ("RunStage", "GetTrainerStatus", "ContinueStage", "RestoreCheckpoint",
                 "RecordScalars")},
    # A frozen deployment (identity `teacher`, which may call nothing else) loads an earlier
    # stage's weights.
    "/kiln.v1.Trainer/FetchStageExport": frozenset({"teacher"}),
    "/kiln.v1.WeightSync/Publish": frozenset({"trainer"}),
    "/kiln.v1.WeightSync/Subscribe": frozenset({"rollout"}),
    "/kiln.v1.WeightSync/Ack": frozenset({"rollout"}),
    "/kiln.v1.WeightSync/Status": frozenset({"operator", "trainer", "rollout"}),
}
_OPEN_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


def allowed(method: str, component: str) -> bool:
    if method.startswith(_OPEN_PREFIXES):
        return True
    callers = CALLERS.get(method)
    return callers is not None and (component in callers or ANY in callers)


def server_credentials(bundle: Bundle) -> grpc.ServerCredentials:
    """Credentials that serve `bundle`'s certificate and admit clients of its trust bundle; its
    expiry is exported (`kiln_certificate_expiry_timestamp_seconds`) for the renewal alert."""
    cert = x509.load_pem_x509_certificate(bundle.cert)
    names = cert.subject.get_attributes_for_oid(x509.NameOID.COMMON_NAME)
    CERTIFICATE_EXPIRY.labels(names[0].value if names else "").set(
        cert.not_valid_after_utc.timestamp())
    return grpc.ssl_server_credentials([(bundle.key, bundle.cert)], root_certificates=bundle.ca,
                                       require_client_auth=True)


def peer_component(context: grpc.aio.ServicerContext) -> str | None:
    """The caller's component (its certificate's common name), None without a verified one."""
    names = (context.auth_context() or {}).get("x509_common_name") or []
    return names[0].decode() if names else None


class AuthorizationInterceptor(grpc.aio.ServerInterceptor):
    """Refuses each RPC the caller's component may not make (`CALLERS`). Installed on servers
    that serve mutual TLS only."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        method = details.method
        if handler is None or method.startswith(_OPEN_PREFIXES):
            return handler  # the TLS handshake has already checked the caller's certificate

        async def check(context: grpc.aio.ServicerContext) -> None:
            who = peer_component(context)
            if who is None:
                await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                    "no client certificate of this job's CA")
            if not allowed(method, who):
                _REFUSALS.log(log, logging.WARNING, (method, who), "refused %s from %s",
                              method, who)
                await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                    f"{who} may not call {method}")

        def unary(fn):
            async def inner(request, context):
                await check(context)
                return await fn(request, context)
            return inner

        def stream(fn):
            async def inner(request, context):
                await check(context)
                async for item in fn(request, context):
                    yield item
            return inner

        return rewrap(handler, unary, stream)
