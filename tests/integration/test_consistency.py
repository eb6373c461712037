"""`kiln consistency` end to end: vLLM and the Megatron trainer agree before and after a sync."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest

from kiln.models.tiny import make_tiny_model, train_tokenizer

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied-embeddings"])
def test_consistency_command_reports_ok_for_both_versions(tmp_path, tied) -> None:
    # Tied embeddings are the harder case for an in-place reload on the CPU: vLLM computes
    # logits with a prepacked copy of the embedding that a reload must refresh.
    tok = train_tokenizer([f"compute {i} * {i + 3} and answer" for i in range(200)],
                          tmp_path / "tok", vocab_size=320)
    model = make_tiny_model(tmp_path / "model", tok, tie_word_embeddings=tied)
    proc = subprocess.run(
        [sys.executable, "-m", "kiln.cli.main", "consistency", "--model", str(model),
         "--samples", "3", "--max-tokens", "16"],
        capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    rows = re.findall(r"^\s+(\d+)\s+(\d+)\s+(\S+)\s+(\S+)\s+(OK|MISMATCH)$", proc.stdout, re.M)
    assert [r[0] for r in rows] == ["0", "1"], proc.stdout
    for _, n, mx, mean, verdict in rows:
        assert int(n) > 0 and verdict == "OK" and float(mx) < 1e-4 and float(mean) <= float(mx)
    moved = float(re.search(r"by (\S+) on average", proc.stdout).group(1))
    assert moved > 1e-3  # the step really changed the weights that were synced

