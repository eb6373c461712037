"""Trajectories rollout keeps as JSON lines for `kiln trajectories`.

The buffer compacts what has been trained on, so rollout keeps its own record to read: every
`every`-th finished training trajectory (`trajectories.jsonl`) and every evaluation episode
(`evaluations.jsonl`, beside it), so that a held-out failure can be read and not only counted.
"""
from __future__ import annotations

import json
from pathlib import Path

from kiln.trajectory import Trajectory


class Samples:
    def __init__(self, path: Path | None, every: int = 10) -> None:
        self.path, self.every = path, every

    def keep(self, stage: str, trajs: list[Trajectory], finished_before: int) -> None:
        """`trajs`, finished after `finished_before` others: those whose count is a multiple
        of `every`."""
        if self.path is None:
            return
        with open(self.path, "a") as f:
            for i, t in enumerate(trajs):
                if (finished_before + i) % self.every == 0:
                    f.write(json.dumps({"stage": stage, **t.to_dict()}) + "\n")

    def keep_evaluation(self, task_set: str, temperature: float, version: int,
                        traj: Trajectory) -> None:
        """One evaluation episode: stage `eval/<task set>`, at `temperature` (0: greedy), of
        the evaluation that began at policy `version`."""
        if self.path is None:
            return
        with open(self.path.with_name("evaluations.jsonl"), "a") as f:
            f.write(json.dumps({"stage": f"eval/{task_set}", "temperature": temperature,
                                "version": version, **traj.to_dict()}) + "\n")
