"""Prometheus metrics of the operator process itself (the services' metrics are elsewhere).

Not covered: job metrics (policy versions, staleness, ...), which the services export.
"""
from __future__ import annotations

from prometheus_client import Counter, Gauge

RECONCILES = Counter(
    "kiln_operator_reconciles_total", "RLJob reconciliations by outcome", ["result"])
JOBS = Gauge("kiln_operator_jobs", "RLJobs known to the operator, by phase", ["phase"])
