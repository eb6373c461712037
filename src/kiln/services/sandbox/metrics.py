"""Prometheus metrics of the sandbox service (start latency, failures, live sandboxes).

The objects are the shared ones of `kiln.services.common.metrics` (the names the dashboard and
alerts use); this module gives them the sandbox's own short names.

Not covered: per-exec metrics (exec time is the agent's business and varies too widely to
alert on).
"""
from __future__ import annotations

from kiln.services.common import metrics as common

START_SECONDS = common.SANDBOX_START_SECONDS
ACTIVE = common.SANDBOX_ACTIVE


class _StartFailures:
    """`kiln_sandbox_failures_total{reason="start"}` under the old per-backend interface."""

    def labels(self, backend: str):
        return common.SANDBOX_FAILURES.labels(backend, "start")


START_FAILURES = _StartFailures()
