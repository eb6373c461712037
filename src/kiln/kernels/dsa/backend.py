"""Choosing between the Triton kernels and the PyTorch references, and building the kernels.

Every DSA function takes `backend="auto" | "triton" | "torch"`:
- "torch": the plain PyTorch reference, on any device.
- "triton": the Triton kernel: compiled for the GPU on CUDA tensors; on CPU tensors run by
  Triton's interpreter (slow: for tests at small sizes), which must be switched on (below).
- "auto": Triton on CUDA tensors; on CPU tensors Triton's interpreter when `KILN_TRITON_INTERPRET=1`,
  else the reference.

The interpreter is a property of the whole process, fixed when `triton` is first imported:
Triton decorates its own library (`tl.zeros`, `tl.sum`, `tl.sort`, ...) at import, compiled or
interpreted, and kernels of the other kind cannot call it. So:
- set `KILN_TRITON_INTERPRET=1` (or Triton's own `TRITON_INTERPRET=1`) in the environment before
  the process imports triton; importing this package first is enough, it passes the first on to
  the second;
- kernels are kept as plain functions and decorated on first use (`jit`), in the process's mode,
  never at import;
- asking for the interpreter when triton was already imported compiled raises an error naming the
  variable, rather than quietly running the reference.

Not covered: autotuning (block sizes are fixed per call, so results never depend on timing).
"""
from __future__ import annotations

import os
import sys
import threading
from typing import Any, Callable, Literal

import torch

Backend = Literal["auto", "triton", "torch"]
Resolved = Literal["triton", "torch"]

INTERPRET_ENV = "KILN_TRITON_INTERPRET"

if os.environ.get(INTERPRET_ENV) == "1" and "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"

_lock = threading.Lock()
_cache: dict[Callable[..., Any], Any] = {}


def interpreting() -> bool:
    """Whether this process's Triton library was built for the interpreter."""
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.zeros, InterpretedFunction)


def resolve(backend: str, *tensors: torch.Tensor) -> Resolved:
    """The implementation that runs for `backend` and these tensors.

    Raises ValueError for an unknown backend name, tensors on different devices, or Triton on
    CPU tensors without the interpreter; retrying does not help, the call or environment must
    change.
    """
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"backend must be 'auto', 'triton' or 'torch', got {backend!r}")
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    device = next(iter(devices)) if devices else torch.device("cpu")
    if backend == "torch":
        return "torch"
    if device.type == "cuda":
        return "triton"
    if device.type != "cpu":
        if backend == "triton":
            raise ValueError(f"backend='triton' runs on cuda or (interpreted) cpu tensors, not {device}")
        return "torch"
    if backend == "auto" and os.environ.get(INTERPRET_ENV) != "1":
        return "torch"
    if not interpreting():
        raise ValueError(
            f"backend={backend!r} on CPU tensors needs Triton's interpreter, which is chosen when triton "
            f"is first imported: set {INTERPRET_ENV}=1 (or TRITON_INTERPRET=1) in the environment "
            "before the process imports triton"
        )
    return "triton"


def jit(fn: Callable[..., Any]) -> Any:
    """`triton.jit(fn)` in the process's mode (compiled or interpreted), built once per fn."""
    with _lock:
        kernel = _cache.get(fn)
        if kernel is None:
            kernel = _decorate(fn)
            _cache[fn] = kernel
    return kernel


def _decorate(fn: Callable[..., Any]) -> Any:
    import triton
    from triton import knobs

    # Triton reads its `interpret` knob when it wraps a function; make that agree with the mode its
    # own library was built in, whatever the environment says now.
    with knobs.runtime.scope():
        knobs.runtime.interpret = interpreting()
        return triton.jit(fn)
