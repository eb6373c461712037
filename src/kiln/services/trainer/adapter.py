"""The trainer's LoRA adapter (`spec.model.lora`): what the engine keeps of it and how it
checkpoints, publishes and exports it. The adapter math and its tensor parallelism live in
`kiln.models.lora`.

`TrainerAdapter` freezes the engine's model as it is and puts the adapter on; `base` says
where those frozen weights come from: "model_dir" (the checkpoint the job starts from, so
trainer checkpoints keep the adapter alone) or "trained" (earlier full-weight stages trained
them, so checkpoints keep the base too). A policy version carries the adapter and the digest of
that base (`lora.version_tensors`); exports of whole models are merged. The engine puts it on
at construction, or, in a LoRA stage that follows full-weight ones (`LoraSpec.stages`), at that
stage's first step; its optimizer then holds the adapter alone.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import torch

from kiln.api.model import LoraSpec
from kiln.models import lora, parallel
from kiln.models.arch import ArchSpec
from kiln.models.hf_io import iter_hf_tensors, write_hf_dir

AdapterBase = Literal["model_dir", "trained"]


class TrainerAdapter:
    def __init__(self, model: torch.nn.Module, spec: ArchSpec, lora_spec: LoraSpec, *, seed: int,
                 base: AdapterBase, dtype: torch.dtype) -> None:
        """Freeze `model` (of the job's `dtype`) and put the adapter on (collective at TP > 1)."""
        self.model, self.spec, self.lora, self.base, self.dtype = model, spec, lora_spec, base, dtype
        self.digest = lora.weights_digest(iter_hf_tensors(model, spec), dtype)
        """`lora.weights_digest` of the frozen base, which every version names."""
        self.base_version = 0
        """The policy version the frozen base was published as (0: the job's checkpoint)."""
        lora.attach(model, spec, lora_spec, seed)

    def version_tensors(self):
        return lora.version_tensors(self.model, self.spec, self.digest)

    def write_merged(self, out_dir: Path, source_dir: Path) -> Path | None:
        """The merged model as a HF checkpoint (collective at TP > 1; TP rank 0 writes)."""
        tensors = lora.merged_hf_tensors(self.model, self.spec)
        if parallel.tp_rank() != 0:
            for _ in tensors:  # take part in the gathers
                pass
            return None
        return write_hf_dir(tensors, out_dir, source_dir=source_dir)

    def write_peft(self, out_dir: Path, source_dir: Path, base_model: str | None = None) -> Path | None:
        """The adapter in PEFT's format, for the base `base_model` (default `source_dir`);
        collective at TP > 1, TP rank 0 writes."""
        tensors = list(lora.adapter_hf_tensors(self.model, self.spec))
        if parallel.tp_rank() != 0:
            return None
        return lora.write_peft_dir(tensors, self.lora, out_dir, source_dir=source_dir, base_model=base_model)

    def meta(self) -> dict[str, Any]:
        return {"lora": self.lora.model_dump(), "lora_base": self.base,
                "lora_base_version": self.base_version}

    @staticmethod
    def spec_in(meta: dict[str, Any]) -> tuple[LoraSpec, AdapterBase] | None:
        """The adapter a checkpoint's meta says its model had, or None."""
        return (LoraSpec.model_validate(meta["lora"]), meta["lora_base"]) if meta.get("lora") else None

    def model_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """What a checkpoint keeps of the model's `state`: the adapter alone over a `model_dir` base."""
        return {n: t for n, t in state.items() if ".lora." in n} if self.base == "model_dir" else state

    def load_model_state(self, state: dict[str, torch.Tensor], path: Path) -> None:
        if self.base == "trained":  # the base the adapter sits on comes with the checkpoint
            self.model.load_state_dict(state, strict=True)
            self.digest = lora.weights_digest(iter_hf_tensors(self.model, self.spec), self.dtype)
            return
        mine = set(self.model_state(self.model.state_dict()))
        if set(state) != mine:
            raise ValueError(f"{path}: its adapter tensors do not match spec.model.lora's (missing "
                             f"{sorted(mine - set(state))[:3]}, unexpected {sorted(set(state) - mine)[:3]})")
        self.model.load_state_dict(state, strict=False)
