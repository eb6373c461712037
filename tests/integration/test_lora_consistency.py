"""`kiln consistency --lora-rank`: vLLM serving base + a synced adapter (merged before the reload)
agrees with the trainer's adapted model within 1e-5 in float32, before and after a sync, and a
version carries a small part of the model's bytes."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest

from kiln.models.tiny import make_tiny_model, train_tokenizer

pytestmark = pytest.mark.slow


def test_lora_consistency_with_vllm(tmp_path) -> None:
    tok = train_tokenizer([f"compute {i} * {i + 3} and answer" for i in range(200)],
                          tmp_path / "tok", vocab_size=320)
    model = make_tiny_model(tmp_path / "model", tok, tie_word_embeddings=True)
    proc = subprocess.run(
        [sys.executable, "-m", "kiln.cli.main", "consistency", "--model", str(model), "--engine", "vllm",
         "--samples", "3", "--max-tokens", "16", "--lora-rank", "4", "--lr", "1e-2", "--threshold", "1e-5"],
        capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    rows = re.findall(r"^\s+(\d+)\s+(\d+)\s+(\S+)\s+(\S+)\s+(OK|MISMATCH)$", proc.stdout, re.M)
    assert [r[0] for r in rows] == ["0", "1"], proc.stdout
    for _, n, mx, _, verdict in rows:
        assert int(n) > 0 and verdict == "OK" and float(mx) <= 1e-5
    moved = float(re.search(r"by (\S+) on average", proc.stdout).group(1))
    assert moved > 1e-2  # the adapter's step really changed what rollout serves
    synced, whole = map(int, re.search(r"carried (\d+) bytes, the model is (\d+) bytes", proc.stdout).groups())
    assert synced * 10 <= whole
