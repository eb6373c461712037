"""Make Megatron-core 0.16.1 run on a machine without CUDA.

Megatron allocates buffers with `device=torch.cuda.current_device()`, builds its default causal
mask and some optimizer/DDP buffers on `'cuda'`, and keeps its dropout RNG in a CUDA RNG tracker.
On a CPU-only host (CI, laptops) `install()` patches exactly these, and only when
`torch.cuda.is_available()` is false, so the same code runs unchanged on GPUs:

- `torch.cuda.current_device()` returns the CPU device;
- the RNG tracker is the inference kind (it does not fork a CUDA generator);
- `cuda_to_cpu()` is a `TorchFunctionMode` that rewrites `device='cuda'` arguments to CPU, for
  the code paths that hard-code the string (Megatron's DDP, optimizer and schedules).

What this does not cover: fused kernels (keep fusions off in the TransformerConfig) and the
default attention mask (always pass an explicit one); see `megatron_model.py`.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.overrides import TorchFunctionMode

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


def _to_cpu(device: object) -> object:
    if isinstance(device, str) and device.startswith("cuda"):
        return torch.device("cpu")
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    if isinstance(device, int):
        return torch.device("cpu")
    return device


class _CudaToCpu(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if "device" in kwargs:
            kwargs = {**kwargs, "device": _to_cpu(kwargs["device"])}
        if func in (torch.Tensor.cuda,):
            return args[0]
        if func is torch.Tensor.to and args and len(args) > 1:
            args = (args[0], _to_cpu(args[1]), *args[2:])
        return func(*args, **kwargs)


@contextlib.contextmanager
def cuda_to_cpu() -> Iterator[None]:
    """Inside the block, tensors asked for on 'cuda' are made on the CPU (no-op with CUDA)."""
    if not cpu_only():
        yield
        return
    with _CudaToCpu():
        yield
