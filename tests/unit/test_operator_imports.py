"""The operator stays in its layer: no torch, vLLM or Megatron, nothing from kiln.services."""
from __future__ import annotations

import subprocess
import sys


def test_operator_imports_no_engine_and_no_service_code() -> None:
    code = (
        "import sys\n"
        "import kiln.operator.main, kiln.operator.handlers\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'vllm', 'megatron')"
        " or m.startswith('kiln.services'))\n"
        "print(','.join(bad))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == ""
