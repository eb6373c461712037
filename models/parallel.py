"""Process-group set-up for Megatron models: torch.distributed plus Megatron's model-parallel groups.

Models run tensor parallelism only (data- and pipeline-parallel size 1): a world of `tp`
processes, one per tensor-parallel rank. Gloo on the CPU, NCCL on GPUs. A single process
(`tp == 1`) still needs a process group because Megatron's layers ask for one; it gets a
private one on a free loopback port.

Not covered: data parallelism, pipeline parallelism, multi-node rendezvous beyond what
`torch.distributed`'s `env://` gives (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE).
"""
from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist

from kiln.models import cpu_shims


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_parallel(tp: int = 1, *, rank: int | None = None, init_method: str | None = None, seed: int = 0) -> None:
    """Join (or create) the process group of `tp` ranks, build Megatron's groups and seed
    torch and Megatron's RNG tracker with `seed`.

    `rank` defaults to $RANK (0 when unset). `init_method` defaults to env:// when MASTER_ADDR
    is set, otherwise to a fresh loopback port (only valid for `tp == 1`). Idempotent for the
    same `tp`.
    """
    from megatron.core import parallel_state

    cpu_shims.install()
    if tp < 1:
        raise ValueError(f"tensor_parallel={tp} must be >= 1")
    if dist.is_initialized():
        if dist.get_world_size() != tp:
            raise ValueError(
                f"a process group of {dist.get_world_size()} ranks exists; tensor_parallel={tp} "
                "needs exactly that many (destroy it first with shutdown_parallel())"
            )
    else:
        rank = int(os.environ.get("RANK", "0")) if rank is None else rank
        if init_method is None:
            if "MASTER_ADDR" in os.environ:
                init_method = "env://"
            elif tp == 1:
                init_method = f"tcp://127.0.0.1:{free_port()}"
            else:
                raise ValueError(
                    f"tensor_parallel={tp} needs MASTER_ADDR/MASTER_PORT or an init_method "
                    "shared by all ranks"
                )
        backend = "gloo" if cpu_shims.cpu_only() else "nccl"
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=tp)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    cpu_shims.reset_rng(seed)


def shutdown_parallel() -> None:
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def tp_rank() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_rank()


def tp_size() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_world_size()


def tp_group() -> "dist.ProcessGroup":
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_group()


def all_gather_tp(shard: torch.Tensor, dim: int) -> torch.Tensor:
    """Concatenate every TP rank's `shard` along `dim` (returns `shard` itself at TP=1)."""
    if tp_size() == 1:
        return shard
    parts = [torch.empty_like(shard) for _ in range(tp_size())]
    dist.all_gather(parts, shard.contiguous(), group=tp_group())
    return torch.cat(parts, dim=dim)
