"""Serving a LoRA policy: each version carries only the adapter, merged here into the base.

A LoRA job's weight sync ships A and B of every adapted projection under PEFT's names
(`kiln.models.lora.adapter_hf_tensors`), a few percent of the model. `AdapterMergingEngine` wraps
any engine (vLLM, megatron, torch): on `apply_weights` it computes `W + (alpha / r) * B @ A`
from the pristine base weights, read from the checkpoint directory on the first version and
kept, and hands the engine the complete merged weight set, which every engine reloads as it
reloads a full version. Merging into the pristine copy, never into the weights served, keeps
versions from accumulating. A version of full weights (no adapter names: stages that train every
weight before a LoRA stage, `LoraSpec.stages`) passes through and becomes the base.

Each adapter version names the digest of the base it was trained on (`lora.BASE_DIGEST`); one
whose base is not the one held here is refused, and the old weights are kept: a merge into the
wrong base would be served as the policy while being no policy the trainer computed. A replica
restarted (or added) during a LoRA stage that follows full-weight stages starts from the job's
checkpoint; the weight-sync service sends it the last version of complete weights before the
adapter (`WeightStore.base_for`), which it takes as its base here.

vLLM's own LoRA serving (an adapter per request) is not used: merging keeps one code path and
the engines' bit-level agreement with the trainer's merged exports for every engine kind. The
cost is a second copy of the base weights in the rollout process.
"""
from __future__ import annotations

import asyncio
from typing import Any

from kiln.services.rollout.engine import Engine, NamedTensors


class AdapterMergingEngine:
    """`engine` with adapter-only versions merged into the base in `model_dir` (`scaling`:
    alpha / rank). Every other attribute is the wrapped engine's."""

    def __init__(self, engine: Engine, model_dir: str, scaling: float) -> None:
        self._engine, self._model_dir, self._scaling = engine, model_dir, scaling
        self._base: dict[str, Any] | None = None
        self._digest = 0.0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    @property
    def policy_version(self) -> int:
        return self._engine.policy_version

    @property
    def fingerprint(self) -> str:
        return self._engine.fingerprint

    def _load_base(self) -> None:
        import torch

        from kiln.models.arch import ArchSpec
        from kiln.models.hf_io import read_hf_state_dict, weight_rows
        from kiln.models.lora import weights_digest

        if self._base is None:
            # The weights a full version carries (a tied checkpoint may also store lm_head).
            names = {n for _, _, hf in weight_rows(ArchSpec.from_dir(self._model_dir)) for n in hf}
            dtype = getattr(torch, self._engine.settings.dtype)
            # As the trainer holds them (its digest is of weights in the job's dtype).
            self._base = {n: t.to(dtype) for n, t in read_hf_state_dict(self._model_dir).items() if n in names}
            self._digest = weights_digest(self._base.items(), dtype)

    def _merged(self, version: int, named_tensors: list) -> list:
        import torch

        from kiln.models.lora import BASE_DIGEST, merge_adapter, same_digest

        self._load_base()
        digest = [t for n, t in named_tensors if n == BASE_DIGEST]
        if not digest:
            raise ValueError(f"version {version}: an adapter without {BASE_DIGEST} (the base it was trained "
                             "on) is never merged; old weights kept")
        if not same_digest(float(digest[0][0]), self._digest):
            raise ValueError(f"version {version}: its adapter was trained on other base weights (digest "
                             f"{float(digest[0][0]):.12e}, this replica's base {self._digest:.12e}); old "
                             "weights kept")
        with torch.no_grad():
            return merge_adapter(self._base, [(n, t) for n, t in named_tensors if n != BASE_DIGEST],
                                 self._scaling)

    def _rebase(self, named_tensors: list) -> None:
        import torch

        from kiln.models.lora import weights_digest

        self._base = {n: t.clone() for n, t in named_tensors}
        self._digest = weights_digest(self._base.items(), getattr(torch, self._engine.settings.dtype))

    async def apply_weights(self, version: int, named_tensors: NamedTensors) -> None:
        from kiln.models.lora import BASE_DIGEST, is_adapter_name

        tensors = list(named_tensors)
        if tensors and all(is_adapter_name(n) or n == BASE_DIGEST for n, _ in tensors):
            self._engine.check_new_version(version)
            await self._engine.apply_weights(version, await asyncio.to_thread(self._merged, version, tensors))
        else:
            await self._engine.apply_weights(version, tensors)
            await asyncio.to_thread(self._rebase, tensors)  # the base later adapters sit on
