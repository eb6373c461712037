"""Trainer checkpoints on a filesystem: atomic, per-TP-rank, resumable.

Layout: `<root>/step_00000012/` holds `rank_00.pt` ... (one per tensor-parallel rank: model
shard, optimizer state, scheduler, RNG) and `meta.json` (step, policy version, TP size). A
checkpoint is written under `<root>/.tmp-step_00000012/`, every file fsynced, then renamed into
place, so a `step_*` directory is always complete: a crash mid-write leaves only a `.tmp-*`
directory, which the next write of that step replaces and `latest` ignores.

`<root>/protected.json` lists steps that pruning to the newest `keep` spares: a guarded
stage's best evaluated checkpoint (`selection.py`), which it may still restore.

Checkpoints are read with `weights_only=True`: tensors, numbers, strings and containers, never
pickled objects.

Not covered: resharding to a different TP size (export to HF and reload instead), object
stores.
"""
from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from kiln.models import parallel
from kiln.models.hf_io import fsync_dir

PREFIX = "step_"


def step_dir_name(step: int) -> str:
    return f"{PREFIX}{step:08d}"


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under `root`, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX) and (p / "meta.json").exists()]
    return sorted(found, key=checkpoint_step)


def checkpoint_step(path: Path) -> int:
    return int(Path(path).name[len(PREFIX):])


def protected_steps(root: Path) -> list[int]:
    """Steps whose checkpoints pruning spares (`protect`)."""
    path = Path(root) / "protected.json"
    return list(json.loads(path.read_text())) if path.exists() else []


def protect(root: Path, steps: list[int]) -> None:
    """Spare the checkpoints of `steps` (and no others) from pruning, from now on; replaced
    atomically."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / ".protected.json.tmp"
    tmp.write_text(json.dumps(sorted(set(steps))))
    os.replace(tmp, root / "protected.json")


def latest_checkpoint(root: Path) -> Path | None:
    found = list_checkpoints(root)
    return found[-1] if found else None


def _barrier() -> None:
    if parallel.tp_size() > 1:
        dist.barrier(group=parallel.tp_group())


def _save_fsynced(obj: Any, path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def write_checkpoint(root: Path, step: int, meta: dict, rank_state: dict, keep: int) -> Path:
    """Write this rank's `rank_state` and (rank 0) `meta` as checkpoint `step`; collective over
    the TP group. Keeps the newest `keep` checkpoints. Returns the final directory."""
    root = Path(root)
    rank = parallel.tp_rank()
    final = root / step_dir_name(step)
    tmp = root / f".tmp-{step_dir_name(step)}"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    _barrier()
    _save_fsynced(rank_state, tmp / f"rank_{rank:02d}.pt")
    _barrier()
    if rank == 0:
        meta_path = tmp / "meta.json"
        with open(meta_path, "w") as f:
            json.dump({**meta, "step": step, "tensor_parallel": parallel.tp_size()}, f, indent=2)
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        fsync_dir(root)
        spared = set(protected_steps(root))
        for old in list_checkpoints(root)[:-keep]:
            if checkpoint_step(old) not in spared:
                shutil.rmtree(old)
    _barrier()
    return final


def read_checkpoint(path: Path) -> tuple[dict, dict]:
    """(meta, this rank's state) of a checkpoint directory."""
    path = Path(path)
    meta = json.loads((path / "meta.json").read_text())
    if meta["tensor_parallel"] != parallel.tp_size():
        raise ValueError(
            f"checkpoint {path} was written with tensor_parallel={meta['tensor_parallel']}, this "
            f"trainer runs {parallel.tp_size()}; export it to HF format and start from that instead"
        )
    file = path / f"rank_{parallel.tp_rank():02d}.pt"
    try:
        # Tensors, numbers, strings and containers only: a checkpoint is data, and a pickled
        # object in one (a tampered file on a shared volume) would run code when loaded.
        state = torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise ValueError(f"{file}: holds more than tensors and plain values, which Kiln never "
                         f"loads (a checkpoint is data): {str(exc).splitlines()[0]}") from None
    return meta, state
