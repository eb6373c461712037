"""What a training step and a checkpoint need from the other ranks beyond the engine's own
work, for the splits whose ranks hold different shares of a weight's gradient:
- tensor parallelism: the q/k norms of Qwen3 (one weight shared by every head) get from each
  rank only its own heads' share of their gradient; `sum_head_norm_grads` adds the shares (as
  Megatron's gradient finalisation does, which the trainer does not use: `kiln.models.cpu_shims`);
- expert parallelism (`kiln.models.parallel`): `idle_expert_passes` pairs a replica's forward
  passes with the busiest replica's, since every pass through a MoE layer is a collective of
  the expert-parallel group; `sum_over_replicas` sums the dense weights' gradients over all
  data-parallel replicas and the experts' only over the replicas holding the same experts (an
  expert's gradient already holds every token the dispatcher brought it);
  `gather_expert_states` / `expert_part` keep every EP rank's experts and moments in replica 0's
  checkpoints and give each rank its own back on resume."""
from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.distributed as dist

from kiln.models import parallel
from kiln.models.megatron_model import forward_logits


def sum_head_norm_grads(model: torch.nn.Module) -> None:
    """Sum the q/k norm weights' gradients over the TP ranks (a no-op at TP=1)."""
    if parallel.tp_size() == 1:
        return
    grads = [p.grad for n, p in model.named_parameters()
             if p.grad is not None and n.rsplit(".", 2)[-2] in ("q_layernorm", "k_layernorm")]
    if grads:
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=parallel.tp_group())
        for g, part in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(part.view_as(g))


def global_norm(params: list[torch.nn.Parameter], device: torch.device) -> float:
    """The gradient norm of the whole model from this rank's `params`: replicated parameters
    (norms) count once, TP-sharded ones once per shard, and each expert once, on the EP rank
    holding it. Megatron's own clip function assumes CUDA tensors, hence this one."""
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

    sq = torch.zeros((), dtype=torch.float64, device=device)
    experts_sq = torch.zeros((), dtype=torch.float64, device=device)
    for p in params:
        if parallel.is_expert_param(p):
            experts_sq += p.grad.detach().double().pow(2).sum()
        elif param_is_not_tensor_parallel_duplicate(p):
            sq += p.grad.detach().double().pow(2).sum()
    if parallel.ep_size() > 1:
        dist.all_reduce(experts_sq, group=parallel.ep_group())
    sq += experts_sq
    if parallel.tp_size() > 1:
        dist.all_reduce(sq, group=parallel.tp_group())
    return math.sqrt(float(sq))


def sends_experts_to_replica_0() -> bool:
    """Whether this rank is in replica 0's expert-parallel group: it must then take part
    in every gather of the whole model there (weight sync, export), sending its experts."""
    return parallel.ep_size() > 1 and parallel.ep_global_rank(0) == parallel.dp_source_rank()


def sum_over_replicas(model: torch.nn.Module, grads: list[torch.Tensor]) -> None:
    """Sum `grads` (of the model's trainable parameters, in order) over the replicas: the
    dense weights' over all of them, the experts' over those holding the same experts."""
    trained = [p for p in model.parameters() if p.requires_grad]
    parallel.all_reduce_dp([g for p, g in zip(trained, grads) if not parallel.is_expert_param(p)])
    parallel.all_reduce_expert_dp([g for p, g in zip(trained, grads) if parallel.is_expert_param(p)])


def idle_expert_passes(model: torch.nn.Module, passes: int) -> None:
    """With expert parallelism, run empty forward and backward passes until this rank has
    made as many (`passes` of its own) as the busiest rank of its expert-parallel group. An idle
    pass adds nothing to any gradient (its loss is multiplied by 0)."""
    if parallel.ep_size() == 1:
        return
    most = torch.tensor([passes], dtype=torch.long)
    dist.all_reduce(most, op=dist.ReduceOp.MAX, group=parallel.ep_group())
    device = next(model.parameters()).device
    for _ in range(int(most) - passes):
        tokens = torch.zeros((1, 2), dtype=torch.long, device=device)
        (forward_logits(model, tokens).sum() * 0.0).backward()


def gather_expert_states(model_state: dict, optimizer: torch.optim.Optimizer) -> list[dict] | None:
    """With expert parallelism, every EP rank's model and optimizer state, gathered on
    replica 0 (which writes checkpoints) from the ranks of its expert-parallel group (collective
    there); None on the other ranks and without expert parallelism."""
    if not sends_experts_to_replica_0():
        return None
    mine = {"model": model_state, "optimizer": optimizer.state_dict()}
    out = [None] * parallel.ep_size() if parallel.ep_rank() == 0 else None
    dist.gather_object(mine, out, dst=parallel.ep_global_rank(0), group=parallel.ep_group())
    return out


def expert_part(state: dict, path: Path) -> dict:
    """A checkpoint's state as this rank restores it: with expert parallelism, its EP rank's
    model and optimizer (`gather_expert_states`); ValueError for a checkpoint of another split."""
    ep, parts = parallel.ep_size(), state.get("ep_ranks")
    if (len(parts) if parts else 1) != ep:
        raise ValueError(f"{path}: written with spec.trainer.expertParallel "
                         f"{len(parts) if parts else 1}, this trainer runs {ep}; export it to HF "
                         "format and start from that instead")
    return {**state, **parts[parallel.ep_rank()]} if parts else state


def merged_expert_model(parts: list[dict], spec) -> dict:
    """The whole model's state from a checkpoint whose experts were split over EP ranks
    (`ep_ranks`, one part per rank): every rank's experts under their global index, the rows
    all ranks share from rank 0; what a model without expert parallelism loads (`kiln
    export`). ValueError when a part lacks an expert it should hold."""
    from kiln.models.hf_io import expert_split_rows

    merged = dict(parts[0]["model"])
    split, whole = expert_split_rows(spec, len(parts)), expert_split_rows(spec, 1)
    for (_, local_name, _, owner), (_, global_name, _, _) in zip(split, whole):
        if owner is None:
            continue
        try:
            merged[global_name] = parts[owner]["model"][local_name]
        except KeyError:
            raise ValueError(f"EP rank {owner}'s part of the checkpoint lacks {local_name}") from None
    return merged
