"""The training loop of one stage: pull batches, step, publish weights every `sync_interval` steps.

The loop sees the rest of the system through two small protocols, so the same function runs
against the buffer and weight-sync services (gRPC clients that implement them) or, in tests
and one-process runs, against the in-process `ListBatchSource` and `InMemoryPublisher` /
`DirectoryPublisher` below.

Publishing a version means: `engine.new_version()` (which resets AdamW's moments if configured),
then `publisher.publish(version, engine.named_hf_tensors())`. The final weights of a stage are
always published, so the next stage (or an evaluation) starts from them.

Not covered: freshness control (the buffer drops stale trajectories before serving them) and
deciding when a stage ends beyond `max_steps` or an exhausted source.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol

import torch
from pydantic import BaseModel, Field

from kiln.metrics import StepMetrics
from kiln.services.common import metrics as common_metrics
from kiln.services.trainer.engine import TrainerEngine
from kiln.models.hf_io import write_hf_dir
from kiln.trajectory import Trajectory


@dataclass
class StepBatch:
    """What one optimizer step trains on."""

    trajectories: list[Trajectory]
    staleness: list[int] | None = None
    """Per trajectory, versions behind the trainer when served (the buffer's figure); None
    for data that no policy generated (a list of demonstrations)."""


class BatchSource(Protocol):
    def next_batch(self, size: int) -> StepBatch:
        """Block until `size` trajectories are ready and return them. An empty batch means no
        more will come (the stage's data is exhausted); fewer than `size` may come last."""
        ...


class WeightPublisher(Protocol):
    def publish(self, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Make `named_tensors` (HF names, full tensors) policy `version` for the consumers.
        The tensors may share storage with the live model: copy what is kept."""
        ...


class StageSettings(BaseModel):
    kind: Literal["sft", "rl"]
    name: str = ""
    """Stage name for the metrics' label; defaults to `kind`."""
    max_steps: int = Field(ge=1)
    batch_size: int = Field(ge=1)
    sync_interval: int | None = Field(None, ge=1)
    """Publish every this many steps; None publishes only at the end of the stage."""
    hold_every: int | None = Field(None, ge=1)
    """Every this many steps of the stage (but its last), publish and call `hold(step)` before
    the next step: a held-out evaluation of exactly these weights (`eval.every`)."""
    done_steps: int = Field(0, ge=0)
    """Steps of the stage taken before this call (a resumed stage): where hold points fall."""


@dataclass
class StageResult:
    steps: int = 0
    versions: list[int] = field(default_factory=list)
    metrics: list[StepMetrics] = field(default_factory=list)


def publish(engine: TrainerEngine, publisher: WeightPublisher) -> int:
    version = engine.new_version()
    publisher.publish(version, engine.named_hf_tensors())
    return version


def run_stage(
    engine: TrainerEngine,
    source: BatchSource,
    publisher: WeightPublisher,
    settings: StageSettings,
    *,
    should_stop: Callable[[], bool] = lambda: False,
    on_step: Callable[[StepMetrics], None] | None = None,
    hold: Callable[[int], None] | None = None,
) -> StageResult:
    """Train one stage until `max_steps`, an exhausted source, or `should_stop()`; at each of
    `settings.hold_every`'s points, publish and `hold(stage step)` (which returns when the
    stage may go on)."""
    engine.stage = settings.name or settings.kind
    result = StageResult()
    published_at = -1
    while result.steps < settings.max_steps and not should_stop():
        t0 = time.perf_counter()
        batch = source.next_batch(settings.batch_size)
        waited = time.perf_counter() - t0
        common_metrics.TRAINER_IDLE_SECONDS.inc(waited)
        if not batch.trajectories:
            break
        if settings.kind == "rl":
            m = engine.step(batch.trajectories, batch.staleness)
        else:
            m = engine.sft_step(batch.trajectories)
        m.wait_seconds = waited  # what rollout autoscaling reads (kiln.control.autoscale)
        result.steps += 1
        result.metrics.append(m)
        if on_step is not None:
            on_step(m)
        stage_step = settings.done_steps + result.steps
        held = (hold is not None and settings.hold_every is not None and result.steps < settings.max_steps
                and stage_step % settings.hold_every == 0)
        if held or (settings.sync_interval and result.steps % settings.sync_interval == 0):
            result.versions.append(publish(engine, publisher))
            published_at = result.steps
        if held:
            hold(stage_step)
    if result.steps and published_at != result.steps:
        result.versions.append(publish(engine, publisher))
    return result


# --- in-process implementations -------------------------------------------------------------


class ListBatchSource:
    """Serves trajectories from a list in order; `cycle=True` starts over when it runs out. For
    an RL stage, lay the list out so that every batch holds whole groups, as the buffer serves
    them: the trainer takes each group's advantages over the batch (`advantages.py`)."""

    def __init__(self, trajectories: Iterable[Trajectory], *, cycle: bool = False) -> None:
        self._items = list(trajectories)
        self._cycle = cycle
        self._pos = 0
        if cycle and not self._items:
            raise ValueError("a cycling ListBatchSource needs at least one trajectory")

    def next_batch(self, size: int) -> StepBatch:
        out: list[Trajectory] = []
        while len(out) < size:
            if self._pos == len(self._items):
                if not self._cycle:
                    break
                self._pos = 0
            out.append(self._items[self._pos])
            self._pos += 1
        return StepBatch(out)


class InMemoryPublisher:
    """Keeps a copy of every published version (or only the latest)."""

    def __init__(self, *, keep_all: bool = False) -> None:
        self.keep_all = keep_all
        self.versions: list[int] = []
        self.weights: dict[int, dict[str, torch.Tensor]] = {}

    def publish(self, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        if self.versions and version <= self.versions[-1]:
            raise ValueError(f"version {version} is not newer than {self.versions[-1]}")
        tensors = {n: t.detach().clone() for n, t in named_tensors}
        if not self.keep_all:
            self.weights.clear()
        self.weights[version] = tensors
        self.versions.append(version)

    @property
    def latest(self) -> dict[str, torch.Tensor]:
        return self.weights[self.versions[-1]]


class DirectoryPublisher:
    """Writes each version as a HF checkpoint directory `<root>/v000007/` (config and tokenizer
    from `source_dir`), e.g. for vLLM's `reload_weights(weights_path=...)`."""

    def __init__(self, root: Path, source_dir: Path, *, dtype: torch.dtype | None = None) -> None:
        self.root = Path(root)
        self.source_dir = Path(source_dir)
        self.dtype = dtype

    def path(self, version: int) -> Path:
        return self.root / f"v{version:06d}"

    def publish(self, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        write_hf_dir(named_tensors, self.path(version), source_dir=self.source_dir, dtype=self.dtype)


def iter_versions(publisher: DirectoryPublisher) -> Iterator[int]:
    """Versions present under a DirectoryPublisher's root, oldest first."""
    if not publisher.root.is_dir():
        return iter(())
    found = sorted(int(p.name[1:]) for p in publisher.root.iterdir() if p.name.startswith("v") and p.name[1:].isdigit())
    return iter(found)
