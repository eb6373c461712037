"""The run report: which steps it plots and the staleness histogram it draws."""
from __future__ import annotations

import json
from pathlib import Path

from kiln.cli.local.report import staleness_histogram, steps_seen, write_report


def _progress(stage: str, step: int, global_step: int, **trainer) -> dict:
    return {"event": "progress", "stage": stage, "step": step,
            "trainer": {"stage": stage, "global_step": global_step, **trainer},
            "rollout": {"mean_reward": 0.5}, "buffer": {"dropped_stale": 3}}


def test_steps_and_staleness_histogram(tmp_path: Path) -> None:
    recs = [
        _progress("sft", 0, 0),                                   # nothing trained yet
        _progress("sft", 5, 5, loss=1.0),
        _progress("sft", 5, 5, loss=1.0),                          # the same step polled twice
        _progress("rl", 0, 5, loss=1.0),                           # trainer still shows SFT
        _progress("rl", 1, 6, reward=0.2, staleness_counts={"0": 100.0, "1": 28.0}),
        _progress("rl", 1, 6, reward=0.2, staleness_counts={"0": 100.0, "1": 28.0}),
        _progress("rl", 2, 7, reward=0.4, staleness_counts={"1": 120.0, "2": 8.0}),
    ]
    seen = steps_seen(recs)
    assert [g for g, _ in seen] == [5, 6, 7]
    assert [r["stage"] for _, r in seen] == ["sft", "rl", "rl"]
    assert staleness_histogram(seen) == {0: 100.0, 1: 148.0, 2: 8.0}

    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    written = write_report(tmp_path)
    assert {p.name for p in written} == {"reward.png", "masks.png", "mismatch.png", "staleness.png"}
    assert all(p.stat().st_size > 1000 for p in written)
    assert len(write_report(tmp_path, rl_stages={"rl"})) == 4
