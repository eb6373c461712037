"""The trainer engine's checkpoints: what one keeps of the engine (model, optimizer, scheduler,
RNG, counters, stage, the LoRA adapter's spec and base), writing it, resuming from it, and giving
data-parallel replicas replica 0's resumed state. A part of `TrainerEngine` (`engine.py`)."""
from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.distributed as dist

from kiln.metrics import StepMetrics
from kiln.models import parallel
from kiln.services.trainer import checkpoint as ckpt
from kiln.services.trainer import metrics, rank_grads
from kiln.services.trainer.adapter import TrainerAdapter


class EngineCheckpoints:
    """`TrainerEngine`'s checkpoint methods (they use its model, optimizer and counters)."""

    def _sync_replicas(self) -> None:
        """Give every DP replica replica 0's state (its resumed checkpoint, if any): replicas
        other than 0 keep no checkpoints of their own."""
        src = parallel.dp_source_rank()
        resumed = [self.resumed_from is not None]
        dist.broadcast_object_list(resumed, src=src, group=parallel.dp_group())
        if not resumed[0]:
            return  # every replica loaded the same HF checkpoint
        state = [{"model": self._model_state(), "optimizer": self.optimizer.state_dict(),
                  "scheduler": self.scheduler.state_dict(), "meta": self._meta(),
                  "path": str(self.resumed_from), "ep_ranks": self._ep_ranks} if parallel.dp_rank() == 0 else None]
        dist.broadcast_object_list(state, src=src, group=parallel.dp_group())
        if parallel.dp_rank() != 0:
            self._restore(state[0], state[0]["meta"], Path(state[0]["path"]))

    def maybe_checkpoint(self) -> Path | None:
        interval = self.config.checkpoint_interval
        if interval and self.step_count % interval == 0:
            return self.save_checkpoint()
        return None

    def save_checkpoint(self) -> Path:
        if self.config.checkpoint_dir is None:
            raise ValueError("checkpoint_dir is not configured; cannot save a checkpoint")
        ep_ranks = rank_grads.gather_expert_states(self._model_state(), self.optimizer)
        if parallel.dp_rank() != 0:
            # Replica 0 keeps the checkpoints; the others hold the same state.
            self.last_checkpoint = Path(self.config.checkpoint_dir) / ckpt.step_dir_name(self.step_count)
            return self.last_checkpoint
        t0 = time.perf_counter()
        state = {"model": self._model_state(), "optimizer": self.optimizer.state_dict(),
                 "scheduler": self.scheduler.state_dict(), "rng": torch.get_rng_state(),
                 **({"ep_ranks": ep_ranks} if ep_ranks is not None else {})}
        path = ckpt.write_checkpoint(self.config.checkpoint_dir, self.step_count, self._meta(),
                                     state, keep=self.config.keep_checkpoints)
        metrics.CHECKPOINT_SECONDS.observe(time.perf_counter() - t0)
        self.last_checkpoint = path
        return path

    def load_checkpoint(self, path: Path) -> None:
        meta, state = ckpt.read_checkpoint(path)
        self._ep_ranks = state.get("ep_ranks")
        self._restore(state, meta, Path(path))
        torch.set_rng_state(state["rng"])

    def load_weights(self, path: Path) -> None:
        """The model of checkpoint `path` alone (what an export needs): as `load_checkpoint`
        restores it, or, for a checkpoint whose experts were split over EP ranks read by a
        trainer without expert parallelism, every rank's experts merged into this model."""
        meta, state = ckpt.read_checkpoint(path)
        parts = state.get("ep_ranks")
        if parts and len(parts) > 1 and parallel.ep_size() == 1:
            from kiln.models.hf_io import load_state_into

            merged = rank_grads.merged_expert_model(parts, self.spec)
            # Megatron's `_extra_state` entries hold no weights (and only rank 0's are there).
            load_state_into(self.model, {k: v for k, v in merged.items()
                                         if not k.endswith("._extra_state")})
            return
        self._restore(state, meta, Path(path))

    def _meta(self) -> dict:
        """What a checkpoint keeps beside the tensors."""
        return {"step": self.step_count, "policy_version": self.policy_version,
                "published_step": self.published_step, "model_dir": str(self.config.model_dir),
                "last_step": self.last_step and self.last_step.record(),
                "stage": self.stage, "stage_steps": self.stage_steps,
                **(self.adapter.meta() if self.adapter is not None else {})}

    def _model_state(self) -> dict[str, torch.Tensor]:
        state = self.model.state_dict()  # with LoRA: what `TrainerAdapter.model_state` keeps
        return self.adapter.model_state(state) if self.adapter is not None else state

    def _restore(self, state: dict, meta: dict, path: Path) -> None:
        state = rank_grads.expert_part(state, path)
        if self.adapter is None and (found := TrainerAdapter.spec_in(meta)) is not None:
            self._attach_lora(*found)  # a LoRA stage's checkpoint, resumed before the stage runs
        if self.adapter is not None:
            self.adapter.base_version = int(meta.get("lora_base_version", 0))
        if self.adapter is not None:
            self.adapter.load_model_state(state["model"], path)
        else:
            self.model.load_state_dict(state["model"], strict=True)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step_count, self.policy_version = int(meta["step"]), int(meta["policy_version"])
        # A checkpoint that does not say (older ones) is taken as holding unpublished weights:
        # publishing them once more is harmless, serving other weights under its version is not.
        self.published_step = int(meta.get("published_step", -1))
        self.last_step = (StepMetrics.from_record(meta["last_step"])
                             if meta.get("last_step") else None)
        self.stage, self.stage_steps = meta.get("stage"), dict(meta.get("stage_steps") or {})
        self.resumed_from = self.last_checkpoint = path
