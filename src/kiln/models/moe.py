"""Mixture-of-experts layers (Qwen2-MoE, Qwen3-MoE, GLM-4.5, DeepSeek-V3) in the Megatron model, and
routing record/replay.

An MoE model chooses, per token and layer, `topk` of `num_experts` expert MLPs. The choice is a
top-k over router scores, so a difference in the last bit between the inference engine and the
trainer can flip it; the two sides then compute different functions and the off-policy ratio
measures that, not staleness. Routing replay removes it: the rollout records the experts it chose
(`kiln.routing.RoutedExperts` on the trajectory) and the trainer's forward uses them instead of
its own top-k. The router's gate still runs and is trained: the replayed experts' weights are
gathered from the trainer's own scores (Megatron's `get_replay_topk` does the same), so the
gradient reaches the gate through them.

Layout (Qwen2-MoE and Qwen3-MoE; the weight names are the family's table in
`kiln.api.model_families`, applied by `hf_io.py`):
- router: `mlp.gate.weight` [E, H] -> Megatron `mlp.router.weight`; softmax over all experts,
  then top-k (`norm_topk_prob` renormalises the k weights, which is the softmax over the top-k
  logits: Megatron's default order);
- experts: per expert a gated MLP of `moe_intermediate_size` -> `mlp.experts.local_experts.j`;
- shared expert (Qwen2-MoE; Qwen3-MoE has none): a gated MLP of
  `shared_expert_intermediate_size` scaled by `sigmoid(shared_expert_gate(x))` ->
  `mlp.shared_experts` with `gate_weight`.

GLM-4.5 and DeepSeek-V3 (the registry's `DEEPSEEK_MOE_NAMES`) route by sigmoid scores: the router's
`e_score_correction_bias` (Megatron's float32 `expert_bias` buffer, never updated here) is added
for the choice only; with `n_group` > 1 the experts form groups ranked by their 2 best biased
scores and only the best `topk_group` groups compete (Megatron's group-limited top-k, which ranks
by the best topk/topk_group, so the registry requires topk = 2 x topk_group); the k unbiased
scores are renormalised and multiplied by `routed_scaling_factor`; `n_shared_experts` shared
experts (one fused MLP, no gate) add their output; the first `first_k_dense_replace` layers
are dense and have no router (routing covers the MoE layers only, in order).

`RouterTap` replaces each router's `router_replay` hook (Megatron calls it for the top-k) and
serves the three modes per model rather than through Megatron's process-global list of
instances, so that a trainer and an inference engine built in one process do not share state.
Token order inside a router is Megatron's `[S, B]` flattened: index `s * B + b`.

Expert parallelism (`parallel.init_parallel(ep=...)`): each rank holds `num_experts / ep` experts
and Megatron's all-gather token dispatcher sends every rank's tokens to every rank of the
expert-parallel group, which runs its own experts on them and reduce-scatters the outputs back.
That dispatcher needs the same token count on every rank, and replicas train on rows of their
own lengths, so `install_padded_dispatch` pads each rank's tokens to the group's largest count
with tokens routed to no expert (they cost no expert work and receive no gradient) and cuts the
padding off again after the combine. Each rank's forward passes must still pair up with the
other ranks' (the trainer runs empty ones where a replica has fewer micro-batches). Routing and
its replay stay per rank: the router runs before the dispatch, on the rank's own tokens.

Not covered: tensor parallelism of MoE layers (refused at load), Qwen's
dense layers among sparse ones (`decoder_sparse_step` > 1, `mlp_only_layers`; refused by the
family registry), auxiliary load-balancing losses and expert-bias updates (off: RL fine-tuning
keeps the routing the model has).
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from kiln.api.model_families import MoE


@dataclass(frozen=True)
class MoESpec:
    """The MoE part of a Hugging Face config."""

    num_experts: int
    topk: int
    ffn_hidden_size: int
    shared_ffn_hidden_size: int
    """0 when the model has no shared expert."""
    norm_topk_prob: bool
    shared_expert_gate: bool = True
    """The shared expert's output is scaled by sigmoid(gate(x)) (Qwen2-MoE)."""
    score_function: str = "softmax"
    expert_bias: bool = False
    """A per-expert bias added to the sigmoid scores for selection only (`e_score_correction_bias`)."""
    scaling_factor: float | None = None
    """`routed_scaling_factor`: the routed experts' weights are multiplied by it."""
    groups: tuple[int, int] | None = None
    """(n_group, topk_group) of group-limited routing; None: one group."""
    dense_layers: tuple[int, ...] = ()
    """Layers built with a dense MLP instead (DeepSeek's `first_k_dense_replace`)."""

    def is_sparse(self, layer: int) -> bool:
        return layer not in self.dense_layers

    @classmethod
    def from_hf(cls, config: dict, family: MoE) -> "MoESpec":
        """Read a config.json the family registry accepts (`config_problems` is empty)."""
        shared = family.shared_width(config)
        return cls(
            num_experts=family.experts(config), topk=config[family.topk],
            ffn_hidden_size=config[family.ffn], shared_ffn_hidden_size=shared,
            norm_topk_prob=bool(config.get("norm_topk_prob", family.norm_topk_prob)),
            shared_expert_gate=family.shared_expert_gate and bool(shared),
            score_function=family.score, expert_bias=family.expert_bias,
            scaling_factor=family.scaling(config), groups=family.groups(config),
            dense_layers=tuple(family.dense_layers(config)),
        )

    def transformer_config(self, num_layers: int) -> dict:
        """TransformerConfig keyword arguments for these MoE layers."""
        return dict(
            moe_layer_freq=[int(self.is_sparse(i)) for i in range(num_layers)],
            num_moe_experts=self.num_experts,
            moe_router_topk=self.topk,
            moe_ffn_hidden_size=self.ffn_hidden_size,
            moe_shared_expert_intermediate_size=self.shared_ffn_hidden_size or None,
            moe_shared_expert_gate=bool(self.shared_ffn_hidden_size) and self.shared_expert_gate,
            # Qwen2-MoE, Qwen3-MoE: softmax over all experts, then top-k, unnormalised; with norm_topk_prob
            # the k weights sum to 1, which is Megatron's top-k-then-softmax.
            moe_router_pre_softmax=not self.norm_topk_prob,
            # Sigmoid (GLM-4.5, DeepSeek-V3): Megatron adds `expert_bias` to the scores for the
            # top-k only and renormalises the k unbiased scores, as transformers does with
            # norm_topk_prob (the registry refuses it false).
            moe_router_score_function=self.score_function,
            moe_router_enable_expert_bias=self.expert_bias,
            # The bias is part of the checkpoint; RL keeps it (no load-balancing updates).
            moe_router_bias_update_rate=0.0,
            moe_router_topk_scaling_factor=self.scaling_factor,
            moe_router_num_groups=self.groups[0] if self.groups else None,
            moe_router_group_topk=self.groups[1] if self.groups else None,
            # No router dtype: as in HF, the gate's matmul runs in the model's dtype (Megatron's
            # fp32 router path needs transformer-engine); both take the softmax in float32.
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
            moe_token_dispatcher_type="allgather",
            moe_grouped_gemm=False,
            moe_permute_fusion=False,
            moe_router_fusion=False,
            # Makes the router keep a replay hook, which RouterTap then replaces.
            moe_enable_routing_replay=True,
        )


class RouterTap:
    """One router's top-k hook: compute (default), record, or replay with a flip count.

    Megatron's router calls `get_replay_topk(scores, topk, num_groups, group_topk,
    default_compute_topk)` when its `router_replay` is set; this object is set there. In replay
    mode, rows where `valid` is False (positions the rollout did not record) keep the router's
    own choice, and with `apply` False the router's own choice is kept everywhere and only the
    flips are counted (routingReplay `record`).
    """

    def __init__(self) -> None:
        self.mode: str | None = None
        self.recorded: torch.Tensor | None = None
        self.target: torch.Tensor | None = None
        self.valid: torch.Tensor | None = None
        self.apply = True
        self.flips = 0
        self.compared = 0

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        if self.mode == "record":
            probs, idx = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
            self.recorded = idx.detach()
            return probs, idx
        if self.mode == "replay":
            target, valid = self.target.to(scores.device), self.valid.to(scores.device)
            if (pad := scores.shape[0] - target.shape[0]) > 0 and target.shape[1:] == (topk,):
                # A DSA model's forward pads the sequence (dsa.ROW_MULTIPLE); in Megatron's
                # [S, B] token order those positions are the last rows: they keep their own routing.
                target = torch.cat([target, target.new_zeros(pad, topk)])
                valid = torch.cat([valid, valid.new_zeros(pad)])
            if target.shape != (scores.shape[0], topk):
                raise ValueError(f"replayed routing has shape {tuple(target.shape)}, the router "
                                 f"expects {(scores.shape[0], topk)} (tokens, topk)")
            own_probs, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
            with torch.no_grad():
                differs = (own.sort(dim=1).values != target.sort(dim=1).values).any(dim=1) & valid
                self.compared += int(valid.sum())
                self.flips += int(differs.sum())
            if not self.apply:
                return own_probs, own
            chosen = torch.where(valid[:, None], target, own)
            # The replayed experts' weights come from this router's own scores (softmax over all
            # experts, the logits when the top-k are renormalised, or the sigmoids; with an
            # expert bias these are the biased choice scores, which Megatron drops, gathering
            # the unbiased ones itself), so the gate is trained.
            return scores.gather(1, chosen), chosen
        return default_compute_topk(scores, topk, num_groups, group_topk)


def install_taps(model) -> list[RouterTap]:
    """Give every router of `model` its own RouterTap (in layer order) and detach them from
    Megatron's process-global replay list. Called once, when the model is built."""
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.moe.router_replay import RouterReplay

    # Megatron-core 0.16.1 names `te_general_gemm` in the router's matmul without defining it
    # when transformer-engine is absent; None selects its plain torch.mm path.
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None

    taps = []
    for module in model.modules():
        if isinstance(module, TopKRouter):
            old = module.router_replay
            if old is not None and old in RouterReplay.global_router_replay_instances:
                RouterReplay.global_router_replay_instances.remove(old)
            module.router_replay = RouterTap()
            taps.append(module.router_replay)
    model.kiln_router_taps = taps
    return taps


def router_taps(model) -> list[RouterTap]:
    """The model's taps in layer order; empty for a dense model."""
    return getattr(model, "kiln_router_taps", [])


def is_moe_model(model) -> bool:
    return bool(router_taps(model))


@dataclass
class RoutingFlips:
    """Token-layer pairs whose trainer top-k differed from the replayed one, of those compared."""

    flips: int = 0
    compared: int = 0

    @property
    def rate(self) -> float:
        return self.flips / self.compared if self.compared else 0.0


@contextlib.contextmanager
def record_routing(model) -> Iterator[list[torch.Tensor]]:
    """Within the block, forwards record each layer's chosen experts; on exit the yielded list
    holds one `[S * B, topk]` tensor per layer (the last forward's; router token order)."""
    taps = router_taps(model)
    out: list[torch.Tensor] = []
    for t in taps:
        t.mode, t.recorded = "record", None
    try:
        yield out
    finally:
        for t in taps:
            if t.recorded is not None:
                out.append(t.recorded)
            t.mode, t.recorded = None, None


@contextlib.contextmanager
def replay_routing(model, routing_BSLK: torch.Tensor, valid_BS: torch.Tensor | None = None, *,
                   apply: bool = True) -> Iterator[RoutingFlips]:
    """Within the block, one forward of a `[B, S]` batch uses `routing_BSLK` ([B, S, layers,
    topk] expert ids) instead of the routers' own top-k at the `valid_BS` positions (all when
    None); `apply=False` only compares. The yielded RoutingFlips is filled on exit with the
    valid token-layer pairs where the router's own top-k differs from the given one."""
    taps = router_taps(model)
    b, s, layers, k = routing_BSLK.shape
    if layers != len(taps):
        raise ValueError(f"routing covers {layers} layers, the model has {len(taps)} MoE layers")
    # [B, S, L, K] -> per layer [S * B, K], Megatron's token order.
    per_layer = routing_BSLK.permute(2, 1, 0, 3).reshape(layers, s * b, k).long()
    if valid_BS is None:
        valid_BS = torch.ones(b, s, dtype=torch.bool)
    valid = valid_BS.t().reshape(-1).bool()
    for t, target in zip(taps, per_layer):
        t.mode, t.target, t.valid, t.apply, t.flips, t.compared = "replay", target, valid, apply, 0, 0
    stats = RoutingFlips()
    try:
        yield stats
    finally:
        for t in taps:
            stats.flips += t.flips
            stats.compared += t.compared
            t.mode, t.target, t.valid = None, None, None


def recorded_to_BSLK(recorded: list[torch.Tensor], b: int, s: int) -> torch.Tensor:
    """Recorded per-layer `[S' * B, K]` ids -> `[B, S, layers, K]` (S' >= S: a DSA model's
    forward pads the sequence, and the padding positions are dropped)."""
    stacked = torch.stack([r.reshape(-1, b, r.shape[-1])[:s] for r in recorded])  # [L, S, B, K]
    return stacked.permute(2, 1, 0, 3).contiguous()


def install_padded_dispatch(model) -> None:
    """Make every MoE layer's all-gather dispatcher accept a different token count per rank
    (see the module docstring). Called once, when a model with expert parallelism is built."""
    from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher

    for module in model.modules():
        dispatcher = getattr(module, "token_dispatcher", None)
        if isinstance(dispatcher, MoEAllGatherTokenDispatcher):
            dispatcher.__class__ = _padded_dispatcher_class()


_PADDED: type | None = None


def _padded_dispatcher_class() -> type:
    global _PADDED
    if _PADDED is None:
        import torch.distributed as dist
        from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher

        class PaddedAllGatherDispatcher(MoEAllGatherTokenDispatcher):
            def token_dispatch(self, hidden_states, probs):
                n = hidden_states.shape[0]
                self.kiln_tokens = n
                count = torch.tensor([n], dtype=torch.long)
                dist.all_reduce(count, op=dist.ReduceOp.MAX, group=self.tp_ep_group)
                if (pad := int(count) - n) > 0:
                    # Padding rows route nowhere: no expert takes them, so they change no output.
                    hidden_states = torch.cat([hidden_states, hidden_states.new_zeros(pad, hidden_states.shape[1])])
                    probs = torch.cat([probs, probs.new_zeros(pad, probs.shape[1])])
                    self.routing_map = torch.cat(
                        [self.routing_map, self.routing_map.new_zeros(pad, self.routing_map.shape[1])])
                return super().token_dispatch(hidden_states, probs)

            def token_combine(self, hidden_states):
                return super().token_combine(hidden_states)[: self.kiln_tokens]

        _PADDED = PaddedAllGatherDispatcher
    return _PADDED
