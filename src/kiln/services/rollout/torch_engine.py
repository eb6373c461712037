"""`Engine` on a plain transformers model: the second implementation, for fast tests.

Starts in about a second (no engine processes), samples one request at a time per decoding step
(concurrent `generate` calls interleave token by token), and keeps the same version guarantee as
the vLLM engine: weights change only between decoding steps, every token is tagged with the
version that produced it, and a request whose cached keys and values were computed under an
older version recomputes them before its next token, so each recorded log-prob is exactly the
tagged version's log-prob of the token given the whole preceding sequence.

Sampling follows vLLM's semantics: log-probs are those of the raw model distribution (before
temperature and top-p), or with `tempered_logprobs` of softmax(logits / temperature); temperature 0 is greedy; generation stops at `stop_token_ids` or the
model's end-of-sequence token(s), which are kept in the output.

Mixture-of-experts models (the registry's MoE families): with `record_routing`, each generation
carries the experts transformers routed every position to (what each layer's router module
returns: its own softmax or biased, group-limited sigmoid top-k), an implementation independent
of the trainer's Megatron MoE layers,
which is what `kiln consistency --engine torch` uses to measure routing flips. transformers
keeps each layer's experts fused (`mlp.experts.gate_up_proj` [E, 2I, H], `down_proj`
[E, H, I]); weights arriving under the checkpoint's per-expert names are fused on apply.

Not covered: batching across requests (throughput), and token-for-token equality with vLLM's
random streams.
"""
from __future__ import annotations

import asyncio
import random
from typing import Any, Sequence

import torch

from kiln.api.model_families import family_of
from kiln.routing import RoutedExperts
from kiln.services.rollout.engine import (
    EngineBase, EngineSettings, Generation, NamedTensors, SamplingOptions, TopKScores, check_sequence,
    topk_scores)
from kiln.services.rollout.sampling import logprobs_mode as _mode, sample_token


class TorchEngine(EngineBase):
    def __init__(self, model: Any, settings: EngineSettings, eos_token_ids: set[int]) -> None:
        super().__init__(settings, f"torch-{torch.__version__};dtype={settings.dtype};"
                                   f"seed={settings.seed};logprobs={_mode(settings)}")
        self.model = model
        self.eos_token_ids = eos_token_ids
        self._lock = asyncio.Lock()  # one decoding step or one weight update at a time
        self._seeds = random.Random(settings.seed)
        # A sigmoid router's selection bias is a buffer in transformers and a weight to sync.
        self._params = dict(model.named_parameters()) | {
            n: b for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")}
        family = family_of(model.config.to_dict())
        self._num_experts = family.moe.experts(model.config.to_dict()) if family and family.moe else None
        self._moe = self._num_experts is not None
        self._record = self._moe and settings.record_routing
        self._routers = [m for n, m in model.named_modules() if n.endswith(".mlp.gate")] if self._record else []

    @classmethod
    async def start(cls, settings: EngineSettings) -> "TorchEngine":
        from transformers import AutoModelForCausalLM, GenerationConfig

        model = await asyncio.to_thread(
            AutoModelForCausalLM.from_pretrained, settings.model, dtype=getattr(torch, settings.dtype))
        model.eval()
        eos = GenerationConfig.from_pretrained(settings.model).eos_token_id
        eos_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        return cls(model, settings, eos_ids)

    @torch.no_grad()
    def _forward(self, tokens: list[int], new: int, past: Any) -> tuple[torch.Tensor, Any, torch.Tensor | None]:
        """Last-row logits, the cache, and (MoE, recording) the experts of the `new`
        positions: [new, layers, topk]."""
        ids = torch.tensor([tokens[-new:]], dtype=torch.long)
        chosen: list[torch.Tensor] = []
        # Every transformers router returns (logits, weights, expert ids [tokens, k]).
        hooks = [r.register_forward_hook(lambda _m, _i, o: chosen.append(o[2])) for r in self._routers]
        try:
            out = self.model(input_ids=ids, past_key_values=past, use_cache=True)
        finally:
            for h in hooks:
                h.remove()
        routed = torch.stack(chosen, dim=1) if self._record else None
        return out.logits[0, -1].float(), out.past_key_values, routed

    async def generate(self, prompt_token_ids: Sequence[int], sampling: SamplingOptions) -> Generation:
        if not prompt_token_ids:
            raise ValueError("prompt_token_ids must not be empty")
        seed = sampling.seed if sampling.seed is not None else self._seeds.getrandbits(63)
        gen = torch.Generator().manual_seed(seed)
        stops = self.eos_token_ids | set(sampling.stop_token_ids)
        tokens = list(prompt_token_ids)
        out, logps, versions = [], [], []
        past, past_version, cached = None, None, 0
        rows: list[torch.Tensor] = []  # MoE: experts per computed position, in order
        finish = "length"
        for _ in range(sampling.max_tokens):
            async with self._lock:
                version = self.policy_version
                if past is None or past_version != version:
                    past, cached = None, 0  # recompute the whole context under these weights
                    rows = []
                logits, past, routed = await asyncio.to_thread(self._forward, tokens, len(tokens) - cached, past)
                cached, past_version = len(tokens), version
                if routed is not None:
                    rows.append(routed)
            token, logp = sample_token(logits, sampling, gen, self.settings.tempered_logprobs, out)
            tokens.append(token)
            out.append(token)
            logps.append(logp)
            versions.append(version)
            if token in stops:
                finish = "stop"
                break
        # A change of weights reset `rows`: every row kept was routed under the last version.
        experts = (RoutedExperts.pack(torch.cat(rows).numpy(), self._num_experts, version=past_version)
                   if rows else None)
        return Generation(out, logps, versions, finish, routed_experts=experts)

    async def score(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
        return [logp for logp, _, _ in await self.score_topk(sequences, 0)]

    async def score_topk(self, sequences: Sequence[Sequence[int]], k: int) -> list[TopKScores]:
        vocab = self.model.config.vocab_size
        out = []
        for seq in sequences:
            check_sequence(seq, vocab)
            async with self._lock:  # not while weights change
                out.append(await asyncio.to_thread(self._score_topk_one, list(seq), k))
        return out

    @torch.no_grad()
    def _score_topk_one(self, seq: list[int], k: int) -> TopKScores:
        logits = self.model(input_ids=torch.tensor([seq], dtype=torch.long)).logits[0].float()
        return topk_scores(seq, torch.log_softmax(logits[:-1], dim=-1), k)

    async def apply_weights(self, version: int, named_tensors: NamedTensors) -> None:
        async with self._lock:
            self.check_new_version(version)
            tensors = _fuse_experts(list(named_tensors)) if self._moe else list(named_tensors)
            unknown = [n for n, _ in tensors if n not in self._params]
            if unknown:
                raise ValueError(f"weights {unknown[:5]} are not parameters of the model; "
                                 "old weights kept")
            missing = sorted(set(self._params) - {n for n, _ in tensors})
            if missing:
                # A version is applied whole or not at all: a part of it would be served as N.
                raise ValueError(f"weights for version {version} lack {missing[:5]} "
                                 f"({len(missing)} of {len(self._params)}); old weights kept")
            for name, t in tensors:
                if t.shape != self._params[name].shape:
                    raise ValueError(f"weight {name} has shape {tuple(t.shape)}, expected "
                                     f"{tuple(self._params[name].shape)}; old weights kept")
            with torch.no_grad():
                for name, t in tensors:
                    self._params[name].copy_(t)
            self._switched_to(version)

    async def close(self) -> None:
        self.model = None


def _fuse_experts(tensors: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """Checkpoint names `...mlp.experts.J.{gate,up,down}_proj.weight` -> transformers' fused
    `...mlp.experts.gate_up_proj` [E, 2I, H] and `...mlp.experts.down_proj` [E, H, I]."""
    import re

    pattern = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")
    out, parts = [], {}
    for name, t in tensors:
        m = pattern.match(name)
        if m is None:
            out.append((name, t))
        else:
            parts.setdefault(m.group(1), {})[(int(m.group(2)), m.group(3))] = t
    for prefix, p in parts.items():
        n = 1 + max(j for j, _ in p)
        try:
            out.append((prefix + ".gate_up_proj",
                        torch.stack([torch.cat([p[(j, "gate")], p[(j, "up")]]) for j in range(n)])))
            out.append((prefix + ".down_proj", torch.stack([p[(j, "down")] for j in range(n)])))
        except KeyError as e:
            raise ValueError(f"weights of {prefix} lack expert {e.args[0]}; old weights kept") from None
    return out
