"""In-process stand-ins for a service's status record, for the driver and autoscaler tests."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class FakeBufferStatus:
    depth: int = 0
    dropped_stale: int = 0
    max_staleness: int = -1
