"""Who may call what: the authorization table as reviewed (every RPC of every Kiln service, each
with exactly the components that may call it, written out by hand in `helpers.authorization`
rather than read from the code), a method without an entry denied to everyone, and the NetworkPolicies admitting the same callers.
The same rules over the wire, with real certificates: test_authorization_mtls.py."""
from __future__ import annotations

import pytest

from kiln.protos.kiln.v1 import (buffer_pb2, env_pb2, rollout_pb2, sandbox_pb2, trainer_pb2,
                                 weight_sync_pb2)
from kiln.services.common.tls import CALLERS, allowed
from kiln.tls import COMPONENTS

from helpers.authorization import REVIEWED, REVIEWED_CLIENTS

MODULES = (buffer_pb2, env_pb2, rollout_pb2, sandbox_pb2, trainer_pb2, weight_sync_pb2)


def _methods() -> set[str]:
    out = set()
    for module in MODULES:
        for service in module.DESCRIPTOR.services_by_name.values():
            out |= {f"/{service.full_name}/{m.name}" for m in service.methods}
    return out


def test_the_table_is_the_reviewed_one() -> None:
    assert len(REVIEWED) == 33
    assert set(REVIEWED) == _methods()  # the protos have no RPC the review has not seen
    assert {m: set(c) for m, c in CALLERS.items()} == REVIEWED


@pytest.mark.parametrize("component", COMPONENTS)
def test_each_component_may_call_exactly_its_methods(component: str) -> None:
    for method, callers in REVIEWED.items():
        assert allowed(method, component) == (component in callers), (method, component)
    # Health checks and reflection are open to any caller the TLS handshake let in.
    assert allowed("/grpc.health.v1.Health/Check", component)
    assert allowed("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", component)
    # A method nobody reviewed is denied, even one on a real service.
    assert not allowed("/kiln.v1.Buffer/Unknown", component)
    assert not allowed("/kiln.v1.Buffer/put", component)


def test_network_policies_admit_exactly_the_reviewed_callers() -> None:
    from kiln.operator.children import GRPC_CLIENTS

    assert {c: set(v) for c, v in GRPC_CLIENTS.items()} == REVIEWED_CLIENTS
    # And the policies admit every caller the table lets through, on the serving component.
    served_by = {"Buffer": "buffer", "Environment": "sandbox", "Sandbox": "sandbox",
                 "Rollout": "rollout", "Trainer": "trainer", "WeightSync": "weight-sync"}
    for method, callers in REVIEWED.items():
        assert callers <= REVIEWED_CLIENTS[served_by[method.split("/")[1].rsplit(".", 1)[1]]]
