"""Prometheus collectors of the operator process itself (defined, like every metric, in
`kiln.metrics`; the job's metrics are the services')."""
from __future__ import annotations

from kiln.metrics import ALL, prometheus

RECONCILES = prometheus(ALL["operator_reconciles"])
JOBS = prometheus(ALL["operator_jobs"])
