"""Running a job's stages inside the trainer process.

`StageRunner.start(name)` reconfigures the engine for the stage (learning rate, micro-batch,
loss settings, optimizer-reset policy) and runs `loop.run_stage` in a worker thread, pulling
batches from the buffer and publishing weights through weight-sync. Steps already taken in the
stage (recorded in the engine's checkpoints) are not repeated after a restart.

A finished stage's final weights are also written as a Hugging Face checkpoint,
`<run dir>/stages/<stage>/`, and copied to the job's output folder when it has one
(`spec.output`, `output.py`) before the stage is reported done.

SFT stages publish only at their end: their demonstrations are stamped with the rollout's
current version, and publishing every step would make them look stale. RL stages publish every
`rl.syncInterval` steps. At a stage start the buffer is told the stage's group size and tau and
drops what the previous stage left unserved.

A stage with guard rails (`eval.every`, `select`, `stopOnRegression`) waits at each evaluated
step, its weights published and checkpointed, until the driver says go on (`continue_stage`),
and can be ended on one of those checkpoints (`restore`): the stage's export, the weights
rollout gets and the trainer's latest checkpoint are then that step's (`selection.py`).

Not covered: the gRPC surface (`servicer.py`) and the buffer's and weight-sync's clients.
"""
from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kiln.api.spec import RLJob, RLStage
from kiln.metrics import StepMetrics
from kiln.services.buffer.client import BufferClient
from kiln.tracking import Tracker
from kiln.services.trainer.config import config_from_job, stage_by_name
from kiln.services.trainer import metrics as trainer_metrics
from kiln.services.trainer.engine import TrainerEngine
from kiln.services.trainer.loop import StageSettings, StepBatch, WeightPublisher, publish, run_stage
from kiln.services.trainer.output import (DriverScalars, draw_report, record_samples, record_step,
                                         write_stage_output, write_tensorboard)
from kiln.services.trainer.selection import StageGuard, restore_weights

log = logging.getLogger(__name__)

class BufferBatchSource:
    """`BatchSource` over the buffer: waits for a full batch, acks it once it has been trained on."""

    def __init__(self, buffer: BufferClient, engine: TrainerEngine, stop: threading.Event,
                 keep: Callable[[list], None] | None = None) -> None:
        self.buffer, self.engine, self.stop = buffer, engine, stop
        self.keep = keep
        """Called with each batch's trajectories before they are trained on (the sample log)."""
        self._pending_ack: int | None = None
        # Batches trained on but whose ack may not have reached the buffer: one served again
        # (after a buffer restart) is acked and skipped rather than trained on twice.
        self._trained: set[int] = set()

    def next_batch(self, size: int) -> StepBatch:
        self.ack()
        while not self.stop.is_set():
            batch = self.buffer.get_batch(size, self.engine.policy_version, timeout=2.0)
            if not batch.payloads:
                continue
            if batch.batch_id in self._trained:
                self.buffer.ack_batch(batch.batch_id)
                continue
            self._pending_ack = batch.batch_id
            if self.keep is not None:
                self.keep(batch.trajectories)
            return StepBatch(batch.trajectories, batch.staleness)
        return StepBatch([])

    def ack(self) -> None:
        if self._pending_ack is not None:
            self._trained.add(self._pending_ack)
            self.buffer.ack_batch(self._pending_ack)
            self._pending_ack = None


@dataclass
class StageStatus:
    stage: str = ""
    step: int = 0
    max_steps: int = 0
    done: bool = False
    failed: bool = False
    message: str = ""
    eval_step: int = 0
    """The stage step waiting for its held-out evaluation (`continue_stage`); 0: none."""
    selected_step: int | None = None
    """The stage ended with this stage step's weights (`restore`)."""
    selected_reason: str = ""


class StageRunner:
    def __init__(self, job: RLJob, engine: TrainerEngine, engine_lock: threading.Lock,
                 buffer: BufferClient, publisher: WeightPublisher, run_dir: Path,
                 tracker: Tracker | None = None, output_dir: str | Path | None = None) -> None:
        self.job, self.engine, self.lock = job, engine, engine_lock
        self.output_dir = output_dir
        self.buffer, self.publisher, self.run_dir = buffer, publisher, run_dir
        self.tracker = tracker
        self.driver_scalars = DriverScalars(job, run_dir, output_dir)
        if hasattr(publisher, "adapter_base"):  # a weight-sync that restarted may need the base
            publisher.adapter_base = engine.adapter_base
        self.status = StageStatus()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._go_on = threading.Condition()
        self._continued = 0  # the last evaluated step the driver let the stage go on from

    def start(self, name: str) -> StageStatus:
        """Begin stage `name` (ValueError if unknown); returns at once."""
        stage = stage_by_name(self.job, name)
        if self._thread is not None and self._thread.is_alive():
            if self.status.stage == name:
                return self.status  # idempotent: the driver may retry after a lost reply
            raise ValueError(f"stage {self.status.stage!r} is still running; cannot start {name!r}")
        done = self.engine.stage_steps.get(name, 0)
        self.status = StageStatus(stage=name, step=done, max_steps=stage.max_steps)
        selected = self.guard(name).selected
        if ((done >= stage.max_steps or selected)
                and (stage_export_dir(self.run_dir, name) / "config.json").exists()):
            # Finished (or ended on a selected checkpoint) and exported: a retry (or a
            # restarted trainer) reports it done rather than exporting again under a frozen
            # deployment that may be fetching it.
            self.status.done = True
            if selected:
                self.status.selected_step, self.status.selected_reason = selected["step"], selected["reason"]
            return self.status
        self._stop.clear()
        self._continued = 0
        self._thread = threading.Thread(target=self._run, args=(stage, done), daemon=True,
                                        name=f"stage-{name}")
        self._thread.start()
        return self.status

    def _configure(self, stage) -> None:
        cfg = config_from_job(self.job, run_dir=self.run_dir, stage=stage.name,
                              model_dir=self.engine.config.model_dir)
        with self.lock:
            self.engine.config = self.engine.config.model_copy(update={
                "loss": cfg.loss, "terms": cfg.terms, "optimizer": cfg.optimizer,
                "micro_batch_size": cfg.micro_batch_size, "minibatches_per_step": cfg.minibatches_per_step,
                # A LoRA stage after full-weight ones: the engine adds the adapter at its first step.
                "lora": cfg.lora or self.engine.config.lora})
            for group in self.engine.optimizer.param_groups:
                group["lr"] = cfg.optimizer.lr
                group["initial_lr"] = cfg.optimizer.lr
                group["betas"] = cfg.optimizer.betas
            self.engine.scheduler.base_lrs = [cfg.optimizer.lr] * len(self.engine.optimizer.param_groups)
            if self.engine.stage != stage.name and not self.engine.stage_steps.get(stage.name):
                # A fresh stage reports no step yet, not the previous stage's last one.
                self.engine.last_step = None
            self.engine.stage = stage.name

    def _run(self, stage, done: int) -> None:
        rl = isinstance(stage, RLStage)
        try:
            self._configure(stage)
            self.buffer.configure(group_size=stage.rl.group_size if rl else 1,
                                  tau=stage.rl.tau if rl else None,  # SFT data is not the policy's: no bound
                                  drop_unserved=done == 0)
            trainer_metrics.observe_stage_tau(stage.name, stage.rl.tau if rl else None)
            self.buffer.set_policy_version(self.engine.policy_version)
            remaining = stage.max_steps - done
            every = stage.eval.every if rl and stage.eval else None
            selects = bool(every and (stage.eval.select or stage.eval.stop_on_regression))
            if selects and done == 0:
                self._checkpoint_evaluated(stage.name, 0)  # the weights the stage starts from
            if remaining > 0:
                source = BufferBatchSource(self.buffer, self.engine, self._stop,
                                           keep=self._sampler(stage.name))
                settings = StageSettings(kind="rl" if rl else "sft", name=stage.name,
                                         max_steps=remaining, batch_size=stage.batch_size,
                                         sync_interval=stage.rl.sync_interval if rl else None,
                                         hold_every=every, done_steps=done)
                publisher = _LockedPublisher(self.publisher, self.buffer, self.lock)
                locked = _LockedEngine(self.engine, self.lock, lambda: self._set_lr(stage))
                run_stage(locked, source, publisher, settings, should_stop=self._stop.is_set,
                          on_step=lambda m: self._on_step(m, rl),
                          hold=lambda step: self._hold(stage.name, step, source, selects))
                source.ack()
            if not self._stop.is_set():
                # The stage's final weights, kept as a Hugging Face checkpoint under its name
                # (a later stage or `kiln run`'s final-hf starts from it).
                with self.lock:
                    path = self.engine.export_hf(stage_export_dir(self.run_dir, stage.name))
                self._write_output(stage.name, path, None)
                self.status.done = True
                log.info("stage %s done at step %d, policy version %d; weights in %s", stage.name,
                         self.status.step, self.engine.policy_version, path)
        except Exception as exc:  # reported through status; the driver decides what to do
            log.exception("stage %s failed", stage.name)
            self.status.failed, self.status.message = True, f"{type(exc).__name__}: {exc}"

    def _sampler(self, stage: str) -> Callable[[list], None]:
        """Keeps every `rollout.sampleEvery`-th trajectory trained on in the sample log that
        each stage end copies to the output (`kiln trajectories OUTPUT` reads it)."""
        seen = 0

        def keep(trajs: list) -> None:
            nonlocal seen
            seen = record_samples(self.run_dir, stage, trajs, seen, self.job.spec.rollout.sample_every)
        return keep

    def _set_lr(self, stage) -> None:
        """The stage's learning rate for the step about to be taken (warm-up, then constant
        or cosine); set per step from the stage's own step count, so a resume continues it."""
        done = self.engine.stage_steps.get(stage.name, 0)
        lr = stage.learning_rate * lr_factor(done, stage)
        for group in self.engine.optimizer.param_groups:
            group["lr"] = lr

    def _on_step(self, m: StepMetrics, rl: bool) -> None:
        self.status.step = self.engine.stage_steps.get(self.status.stage, 0)
        record_step(self.run_dir, self.status.stage, m)  # what the output's report plots
        if self.tracker is not None:
            self.tracker.log(m.step, {f"train/{k}": v for k, v in m.scalars(rl=rl).items()})

    def stop(self, timeout: float = 60.0) -> None:
        self._stop.set()
        with self._go_on:
            self._go_on.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    # --------------------------------------------------------------- guard rails
    def guard(self, name: str) -> StageGuard:
        return StageGuard(stage_export_dir(self.run_dir, name).parent, name,
                          self.engine.config.checkpoint_dir)

    def _checkpoint_evaluated(self, name: str, stage_step: int) -> None:
        """Checkpoint the weights of an evaluated step; a candidate while it is the newest
        (pruning keeps the newest) and after, if the driver names it the best."""
        guard = self.guard(name)
        if guard.keep is None and guard.checkpoints:
            guard.protect(min(guard.checkpoints))  # step 0, not judged yet: not pruned by this one
        with self.lock:
            self.engine.save_checkpoint()
        guard.record(stage_step, self.engine.step_count)

    def _hold(self, name: str, stage_step: int, source: BufferBatchSource, selects: bool) -> None:
        """In the stage's thread, at an evaluated step (published already): checkpoint it if
        the stage may end on it, then wait until the driver has evaluated it
        (`continue_stage`) or the stage is stopped."""
        source.ack()  # the batch is trained on: a buffer that restarts meanwhile must not serve it again
        if selects:
            self._checkpoint_evaluated(name, stage_step)
        with self._go_on:
            self.status.eval_step = stage_step
            self._go_on.wait_for(lambda: self._continued >= stage_step or self._stop.is_set())
            self.status.eval_step = 0

    def continue_stage(self, name: str, step: int, keep_step: int) -> StageStatus:
        """The evaluation of `step` is recorded: keep `keep_step`'s checkpoint (the best so
        far) and go on. ValueError for a stage not running or a step with no checkpoint."""
        if self.status.stage != name:
            raise ValueError(f"stage {name!r} is not the one running ({self.status.stage!r})")
        guard = self.guard(name)
        if guard.checkpoints:  # a stage that only evaluates keeps no checkpoints of its own
            guard.protect(keep_step)
        with self._go_on:
            self._continued = max(self._continued, step)
            self._go_on.notify_all()
        return self.status

    def restore(self, name: str, step: int, reason: str) -> StageStatus:
        """End stage `name` with the weights of its evaluated step `step`: stop it, restore
        them, publish them as a new version, checkpoint and export them. Idempotent."""
        stage = stage_by_name(self.job, name)
        guard = self.guard(name)
        if guard.selected and guard.selected["step"] == step and self.status.stage == name \
                and self.status.done:
            return self.status
        path = guard.checkpoint(step)  # ValueError for a step never checkpointed
        self.stop()
        if self._thread is not None and self._thread.is_alive():
            raise TimeoutError(f"stage {name!r} did not stop for the rollback; retry")
        with self.lock:
            restore_weights(self.engine, path)
        publish(_LockedEngine(self.engine, self.lock, lambda: None),
                _LockedPublisher(self.publisher, self.buffer, self.lock))
        with self.lock:
            # The latest checkpoint holds what the stage ended with: a restarted trainer
            # resumes the next stage from it.
            self.engine.save_checkpoint()
            out = self.engine.export_hf(stage_export_dir(self.run_dir, name))
        guard.select(step, reason)
        self._write_output(name, out, step)
        done = self.engine.stage_steps.get(name, 0)
        self.status = StageStatus(stage=name, step=done, max_steps=stage.max_steps, done=True,
                                  selected_step=step, selected_reason=reason)
        log.info("stage %s ends with the weights of its step %d (%s), policy version %d; "
                 "weights in %s", name, step, reason, self.engine.policy_version, out)
        return self.status


    def _write_output(self, name: str, export: Path, selected_step: int | None) -> None:
        if self.output_dir is None:
            return
        write_stage_output(self.output_dir, self.job, name, Path(export), {
            "steps": self.engine.stage_steps.get(name, 0), "selected_step": selected_step,
            "policy_version": self.engine.policy_version}, report=draw_report(self.run_dir, self.job),
            samples=self.run_dir)
        if self.tracker is not None and hasattr(self.tracker, "flush"):
            self.tracker.flush()
        write_tensorboard(self.output_dir, self.run_dir / "tensorboard")
        log.info("stage %s: its model, report, summary and TensorBoard files written to %s",
                 name, self.output_dir)


def stage_export_dir(run_dir: Path, stage: str) -> Path:
    """Where the trainer keeps a finished stage's final weights (a Hugging Face checkpoint)."""
    return Path(run_dir) / "stages" / stage


def lr_factor(step: int, stage) -> float:
    """Multiplier of the stage's learning rate at its `step` (0-based)."""
    if step < stage.warmup_steps:
        return (step + 1) / stage.warmup_steps
    if stage.lr_schedule == "constant":
        return 1.0
    span = max(1, stage.max_steps - stage.warmup_steps)
    progress = min(1.0, (step - stage.warmup_steps) / span)
    return stage.min_lr_ratio + (1 - stage.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class _LockedEngine:
    """The engine with `step`/`sft_step`/`new_version` serialised against RPCs using it, and
    the stage's learning rate set before each step."""

    def __init__(self, engine: TrainerEngine, lock: threading.Lock, before_step) -> None:
        self._engine, self._lock, self._before_step = engine, lock, before_step

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def __setattr__(self, name, value):
        if name.startswith("_"):
            object.__setattr__(self, name, value)
        else:
            setattr(self._engine, name, value)

    def step(self, batch, staleness=None):
        with self._lock:
            self._before_step()
            return self._engine.step(batch, staleness)

    def sft_step(self, batch):
        with self._lock:
            self._before_step()
            return self._engine.sft_step(batch)

    def new_version(self):
        with self._lock:
            return self._engine.new_version()


class _LockedPublisher:
    """Publishes under the engine lock (the tensors are the live weights), then tells the
    buffer the trainer's new version so freshness control applies at once."""

    def __init__(self, inner: WeightPublisher, buffer: BufferClient, lock: threading.Lock) -> None:
        self.inner, self.buffer, self.lock = inner, buffer, lock

    def publish(self, version, named_tensors) -> None:
        t0 = time.perf_counter()
        with self.lock:
            self.inner.publish(version, named_tensors)
        self.buffer.set_policy_version(version)
        log.info("published version %d in %.2f s", version, time.perf_counter() - t0)
