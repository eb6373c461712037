"""Process-group set-up for Megatron models: torch.distributed plus Megatron's model-parallel groups.

A world of `tp * dp` processes: `dp` data-parallel replicas of a model split over `tp`
tensor-parallel ranks. Ranks `r*tp .. r*tp + tp-1` form replica `r`'s TP group (Megatron's
layout, so a replica's ranks can share a node); ranks with the same TP rank form a DP group.
Gloo on the CPU, NCCL on GPUs. A single process (`tp == dp == 1`) still needs a process group
because Megatron's layers ask for one; it gets a private one on a free loopback port.

Expert parallelism (`ep`) splits each MoE layer's experts over `ep` data-parallel replicas, as
Megatron lays it out: the ranks with the same TP rank and consecutive DP ranks `k*ep ..
k*ep + ep-1` form an expert-parallel group, each holding `num_experts / ep` of the experts and
training on its own rows; a layer's tokens travel to the experts' ranks and back through
Megatron's token dispatcher. The dense weights stay replicated over all DP ranks; the expert
weights only over the ranks with the same EP rank (the expert-data-parallel group).

Not covered: pipeline parallelism; rendezvous beyond what `torch.distributed`'s `env://` gives
(MASTER_ADDR, MASTER_PORT).
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


def init_parallel(tp: int = 1, *, dp: int = 1, ep: int = 1, rank: int | None = None,
                  init_method: str | None = None, seed: int = 0, timeout_s: float | None = None) -> None:
    """Join (or create) the process group of `tp * dp` ranks, build Megatron's groups and seed
    torch and Megatron's RNG tracker with `seed`.

    `rank` defaults to $RANK (0 when unset). `init_method` defaults to env:// when MASTER_ADDR
    is set; a world of one uses an in-process store and listens on nothing but loopback. `timeout_s`
    bounds each collective (torch's default when None). Idempotent for the same sizes.
    """
    from datetime import timedelta

    from megatron.core import parallel_state

    cpu_shims.install()
    if tp < 1 or dp < 1:
        raise ValueError(f"tensor_parallel={tp} and data_parallel={dp} must be >= 1")
    if ep < 1 or dp % ep:
        # Megatron carves expert-parallel groups out of the data-parallel ranks.
        raise ValueError(f"expert_parallel={ep} must be >= 1 and divide data_parallel={dp}")
    world = tp * dp
    if dist.is_initialized():
        if dist.get_world_size() != world:
            raise ValueError(
                f"a process group of {dist.get_world_size()} ranks exists; tensor_parallel={tp} x "
                f"data_parallel={dp} needs exactly {world} (destroy it first with shutdown_parallel())"
            )
    else:
        rank = int(os.environ.get("RANK", "0")) if rank is None else rank
        store = None
        if init_method is None and world == 1:
            # A world of one needs no rendezvous: an in-process store instead of a TCPStore,
            # whose server listens on every interface whatever host it is given, and the
            # backends' own sockets kept on loopback.
            store = dist.HashStore()
            for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
                os.environ.setdefault(var, "lo")
        elif init_method is None:
            if "MASTER_ADDR" in os.environ:
                init_method = "env://"
            else:
                raise ValueError(
                    f"a world of {world} ranks needs MASTER_ADDR/MASTER_PORT or an init_method "
                    "shared by all ranks"
                )
        if not cpu_shims.cpu_only():
            # One GPU per rank of a pod: LOCAL_RANK, as torchrun and the trainer's ranks set it.
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank % torch.cuda.device_count())))
        backend = "gloo" if cpu_shims.cpu_only() else "nccl"
        extra = {"timeout": timedelta(seconds=timeout_s)} if timeout_s else {}
        if store is not None:
            dist.init_process_group(backend, store=store, rank=rank, world_size=world, **extra)
        else:
            dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world,
                                    **extra)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep)
    elif ep_size() != ep:
        raise ValueError(f"Megatron's groups were built with expert_parallel={ep_size()}, not {ep} "
                         "(destroy them first with shutdown_parallel())")
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


def dp_size() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_data_parallel_world_size()


def dp_rank() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_data_parallel_rank()


def dp_group() -> "dist.ProcessGroup":
    from megatron.core import parallel_state

    return parallel_state.get_data_parallel_group()


def dp_source_rank() -> int:
    """Global rank of this rank's DP-rank-0 peer (the replica that owns checkpoints)."""
    return dist.get_rank() % tp_size()


def all_reduce_dp(tensors: list[torch.Tensor]) -> None:
    """Sum `tensors` in place over the DP group, as one flat buffer (one message, not one per
    tensor). A no-op at DP=1."""
    if dp_size() == 1 or not tensors:
        return
    _all_reduce_flat(tensors, dp_group())


def _all_reduce_flat(tensors: list[torch.Tensor], group: "dist.ProcessGroup") -> None:
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, group=group)
    offset = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[offset : offset + n].view_as(t))
        offset += n


def ep_size() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_expert_model_parallel_world_size()


def ep_rank() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_expert_model_parallel_rank()


def ep_group() -> "dist.ProcessGroup":
    from megatron.core import parallel_state

    return parallel_state.get_expert_model_parallel_group()


def ep_global_rank(ep_rank_: int) -> int:
    """Global rank of EP rank `ep_rank_` of this rank's expert-parallel group."""
    return dist.get_global_rank(ep_group(), ep_rank_)


def expert_dp_group() -> "dist.ProcessGroup":
    """The ranks holding the same experts (the same EP rank in other EP groups)."""
    from megatron.core import parallel_state

    return parallel_state.get_expert_data_parallel_group()


def expert_dp_size() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_expert_data_parallel_world_size()


def is_expert_param(p: torch.Tensor) -> bool:
    """Whether `p` is one of this rank's experts (Megatron marks them `allreduce = False`: their
    gradients are summed over the expert-data-parallel group, not all replicas)."""
    return not getattr(p, "allreduce", True)


def all_reduce_expert_dp(tensors: list[torch.Tensor]) -> None:
    """`all_reduce_dp` over the expert-data-parallel group (a no-op when it is one rank)."""
    if expert_dp_size() == 1 or not tensors:
        return
    _all_reduce_flat(tensors, expert_dp_group())
