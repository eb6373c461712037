"""Who may call what: every RPC of every Kiln service has an entry in the authorization table
(a method without one would be denied to everyone), and the table names only real methods and
real components."""
from __future__ import annotations

from kiln.protos.kiln.v1 import (buffer_pb2, env_pb2, rollout_pb2, sandbox_pb2, trainer_pb2,
                                 weight_sync_pb2)
from kiln.services.common.tls import CALLERS, allowed
from kiln.tls import COMPONENTS

MODULES = (buffer_pb2, env_pb2, rollout_pb2, sandbox_pb2, trainer_pb2, weight_sync_pb2)


def _methods() -> set[str]:
    out = set()
    for module in MODULES:
        for service in module.DESCRIPTOR.services_by_name.values():
            out |= {f"/{service.full_name}/{m.name}" for m in service.methods}
    return out


def test_every_rpc_has_callers_and_nothing_else_does() -> None:
    assert set(CALLERS) == _methods()
    for method, callers in CALLERS.items():
        assert callers and callers <= set(COMPONENTS), method


def test_the_writes_that_decide_training_have_one_caller() -> None:
    assert CALLERS["/kiln.v1.WeightSync/Publish"] == {"trainer"}
    assert CALLERS["/kiln.v1.Buffer/SetPolicyVersion"] == {"trainer"}
    assert CALLERS["/kiln.v1.Buffer/Put"] == {"rollout"}
    assert not allowed("/kiln.v1.Sandbox/Exec", "trainer")
    assert allowed("/grpc.health.v1.Health/Check", "buffer")
    assert not allowed("/kiln.v1.Buffer/Unknown", "trainer")


SERVED_BY = {"Buffer": "buffer", "Environment": "sandbox", "Sandbox": "sandbox", "Rollout": "rollout",
             "Trainer": "trainer", "WeightSync": "weight-sync"}


def test_network_policies_admit_exactly_the_authorized_callers() -> None:
    from kiln.operator.children import GRPC_CLIENTS

    expected: dict[str, set[str]] = {}
    for method, callers in CALLERS.items():
        component = SERVED_BY[method.split("/")[1].rsplit(".", 1)[1]]
        expected.setdefault(component, set()).update(callers)
    assert {c: set(v) for c, v in GRPC_CLIENTS.items()} == expected
