"""Make Megatron-core 0.16.1 run on a machine without CUDA.

Megatron allocates buffers with `device=torch.cuda.current_device()` and keeps its dropout RNG
in a CUDA RNG tracker. On a CPU-only host (CI, laptops) these patches apply, and only when
`torch.cuda.is_available()` is false, so the same code runs unchanged on GPUs:

- `install()`: `torch.cuda.current_device()` returns the CPU device;
- `reset_rng()`: the RNG tracker is the inference kind (it does not fork a CUDA generator).

What this does not cover: fused kernels (kept off in the TransformerConfig), the default
attention mask (an explicit one is always passed; see `megatron_model.py`), and Megatron's DDP,
distributed optimizer, schedules and gradient clipping, which hard-code CUDA: the trainer uses
`torch.optim.AdamW` and its own tensor-parallel-aware clipping instead (trainer `engine.py`).
"""
from __future__ import annotations

import torch

_installed = False


def cpu_only() -> bool:
    return not torch.cuda.is_available()


def compute_device() -> torch.device:
    """Where the trainer's tensors live: the current CUDA device, else the CPU."""
    return torch.device("cpu") if cpu_only() else torch.device("cuda", torch.cuda.current_device())


def install() -> None:
    """Apply the CPU shims once per process (no-op with CUDA)."""
    global _installed
    if _installed or not cpu_only():
        return
    torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment]
    _installed = True


def reset_rng(seed: int) -> None:
    """Seed torch and (re)create Megatron's RNG tracker in a form that works without CUDA."""
    from megatron.core import tensor_parallel

    if cpu_only():
        tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
        torch.manual_seed(seed)
    else:
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
