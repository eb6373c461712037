"""The operator's status rule, its settings, and the gRPC status reader against real servers."""
from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from kiln.operator.config import OperatorConfig
from kiln.operator.naming import JobRef
from kiln.operator.status import (GrpcStatusReader, Observation, StaticStatusReader,
                                  derive_status, set_condition)
from kiln.protos.kiln.v1 import buffer_pb2, buffer_pb2_grpc
from kiln.services.common.server import Registration, create_server

JOB = JobRef("demo", "ns", "uid-1")
T0, T1 = "2026-01-01T00:00:00Z", "2026-01-01T00:01:00Z"


def serving(trainer: bool = True, buffer: bool = True, **kw: object) -> Observation:
    errors = {c: f"{c}: UNAVAILABLE" for c, ok in (("trainer", trainer), ("buffer", buffer)) if not ok}
    return Observation(serving={"trainer": trainer, "buffer": buffer}, errors=errors, **kw)


def test_pending_until_trainer_and_buffer_serve_then_running() -> None:
    st = derive_status({"phase": "Pending"}, serving(trainer=False), now=T0)
    assert st["phase"] == "Pending"
    ready = next(c for c in st["conditions"] if c["type"] == "Ready")
    assert ready["status"] == "False" and "trainer: UNAVAILABLE" in ready["message"]
    st = derive_status(st, serving(policy_version=3, observed_staleness=1), now=T1)
    assert st["phase"] == "Running"
    assert st["policyVersion"] == 3 and st["observedStaleness"] == 1
    ready = next(c for c in st["conditions"] if c["type"] == "Ready")
    assert ready["status"] == "True" and ready["lastTransitionTime"] == T1


def test_running_job_stays_running_while_a_component_restarts_and_keeps_progress() -> None:
    prev = derive_status({"phase": "Running"}, serving(policy_version=5, step=9, reward=0.5), now=T0)
    st = derive_status(prev, serving(buffer=False), now=T1)
    assert st["phase"] == "Running"
    assert (st["policyVersion"], st["step"], st["reward"]) == (5, 9, 0.5)
    assert next(c for c in st["conditions"] if c["type"] == "Ready")["status"] == "False"


def test_finished_and_failed_trainer_end_the_job() -> None:
    assert derive_status({"phase": "Running"}, serving(finished=True), now=T0)["phase"] == "Succeeded"
    # Succeeded is final even when the services go away afterwards.
    assert derive_status({"phase": "Succeeded"}, serving(False, False), now=T0)["phase"] == "Succeeded"
    st = derive_status({"phase": "Running"}, serving(failure="NaN loss"), now=T0)
    assert st["phase"] == "Failed" and "NaN loss" in st["message"]


def test_condition_transition_time_moves_only_on_status_change() -> None:
    conds = set_condition([], "Ready", "False", "A", "m", T0)
    conds = set_condition(conds, "Ready", "False", "B", "m2", T1)
    assert conds[0]["lastTransitionTime"] == T0 and conds[0]["reason"] == "B"
    conds = set_condition(conds + [{"type": "Valid", "status": "True"}], "Ready", "True", "C", "", T1)
    assert [c["type"] for c in conds] == ["Ready", "Valid"]
    assert conds[0]["lastTransitionTime"] == T1


def test_static_reader_returns_what_it_was_given() -> None:
    reader = StaticStatusReader()
    assert reader.read(JOB).serving == {"trainer": False, "buffer": False}
    reader.set("demo", "ns", serving(policy_version=2))
    assert reader.read(JOB).policy_version == 2


def test_operator_config_from_env_names_a_bad_setting() -> None:
    cfg = OperatorConfig.from_env({"KILN_OPERATOR_STATUS_INTERVAL": "2.5"})
    assert cfg.status_interval == 2.5 and cfg.address_template.endswith(".svc:50051")
    with pytest.raises(ValueError, match="KILN_OPERATOR_GRPC_TIMEOUT"):
        OperatorConfig.from_env({"KILN_OPERATOR_GRPC_TIMEOUT": "-1"})


class _Buffer(buffer_pb2_grpc.BufferServicer):
    """Answers GetStatus like a buffer that has served data (the reader's input, not its logic)."""

    async def GetStatus(self, request, context):  # noqa: N802 - gRPC method name
        return buffer_pb2.BufferStatus(policy_version=11, max_staleness=2, depth=5)


@pytest.fixture()
def services(tmp_path: Path) -> Iterator[tuple[str, asyncio.AbstractEventLoop, object]]:
    """A trainer (health only) and a buffer (health + GetStatus) on unix sockets."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def start() -> tuple[object, object]:
        trainer, _ = await create_server(f"unix:{tmp_path}/demo-trainer.sock", ready=False)
        buffer, _ = await create_server(
            f"unix:{tmp_path}/demo-buffer.sock",
            [Registration(buffer_pb2_grpc.add_BufferServicer_to_server, _Buffer(), "kiln.v1.Buffer")])
        return trainer, buffer

    trainer, buffer = asyncio.run_coroutine_threadsafe(start(), loop).result(10)
    yield f"unix:{tmp_path}/{{name}}-{{component}}.sock", loop, trainer
    for server in (trainer, buffer):
        asyncio.run_coroutine_threadsafe(server.stop(0), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)


def test_grpc_reader_reports_health_and_buffer_status(services) -> None:
    template, _loop, _trainer = services
    reader = GrpcStatusReader(template, timeout=2.0)
    try:
        obs = reader.read(JOB)
        # The trainer answers NOT_SERVING (still building), the buffer serves.
        assert obs.serving == {"trainer": False, "buffer": True}
        assert "NOT_SERVING" in obs.errors["trainer"]
        # Staleness comes from the buffer; the policy version only from the trainer, which owns
        # it (the buffer's copy is not read), and the trainer is not serving yet.
        assert (obs.policy_version, obs.observed_staleness) == (None, 2)
        # Nothing listens for weight-sync: recorded, not fatal.
        assert "UNAVAILABLE" in obs.errors["weight-sync"]
        missing = reader.read(JobRef("other", "ns", "u"))
        assert missing.serving == {"trainer": False, "buffer": False}
        assert missing.policy_version is None
    finally:
        reader.close()
