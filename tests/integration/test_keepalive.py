"""Keepalive: a server built with Kiln's options accepts the keepalive pings of Kiln's clients on
an idle connection. gRPC refuses a third ping within its 5-minute default with GOAWAY
"too_many_pings" (the control: a server with gRPC's defaults), which a misspelt option key
would silently bring back; the real cadence (15 s) is what is tested, so the connections idle
for 80 s (started as soon as the suite knows this test runs: `helpers/keepalive_probe.py`)."""
from __future__ import annotations

import pytest

from helpers import keepalive_probe

pytestmark = pytest.mark.slow


def test_idle_connections_survive_keepalive_pings() -> None:
    out = keepalive_probe.results()
    kiln_out, kiln_err = out["kiln"]
    assert "too_many_pings" not in kiln_err
    assert kiln_out.strip() == "2"  # READY
    # The control: gRPC's server defaults send GOAWAY and the channel goes idle.
    assert "too_many_pings" in out["defaults"][1]
    assert out["defaults"][0].strip() != "2"
