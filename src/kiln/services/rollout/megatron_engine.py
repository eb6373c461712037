"""`Engine` on the trainer's own model code: engine `megatron`, for DSA models and for
checking that rollout and training compute the same numbers.

The model is the Megatron-core GPTModel of `kiln.models`, built and loaded
exactly as the trainer builds it (tensor parallel size 1), DeepSeek sparse attention included
when the checkpoint's config.json has `kiln_dsa`. There is no KV cache: every decoding step runs
the full forward pass over prompt + tokens so far and samples from the last row. That costs
O(length^2) per request, which is fine for the small models this engine is for, and it makes
each step's numbers the trainer's numbers: the same code and the same kernels; for DSA models
also the same per-row arithmetic (see `dsa.ROW_MULTIPLE`), so on the CPU in float32 a recorded
log-prob equals the trainer's log-prob of that token bit for bit (dense models agree to ~1e-6:
PyTorch's fused attention rounds differently at different lengths).

Per token: the log-prob of the raw distribution (before temperature and top-p; with
`tempered_logprobs`, of logits / temperature, as the trainer divides them), computed with
the trainer's vocab-parallel cross entropy (`next_token_logprob`), and the version of the
weights that produced it. Weights change only between decoding steps (a lock serialises steps
and updates), and since nothing is cached, a step after an update sees only the new weights.
For DSA models each generation also carries per-layer hashes of the top-k indices of its last
step (`Generation.index_hashes`), which `TrainerEngine.index_hashes` recomputes; for MoE models
with `record_routing`, the experts of its last step (`Generation.routed_experts`, every
position from the prompt's first), which the trainer replays.

Sampling (temperature, top-p, seeds, stop tokens) follows `torch_engine`. Not covered: tensor
parallelism, batching across requests, long sequences (no cache), and vLLM's random streams.
"""
from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path
from typing import Any, Sequence

import torch

from kiln.models import dsa, moe, parallel
from kiln.models.hf_io import (
    hf_to_megatron_shard, iter_hf_tensors, load_hf_checkpoint, load_state_into, model_tensors)
from kiln.models.megatron_model import (DSABackend, forward_logits, next_token_logprob,
                                        token_logprobs)
from kiln.routing import RoutedExperts
from kiln.services.rollout.engine import (
    EngineBase, EngineSettings, Generation, NamedTensors, SamplingOptions, TopKScores, check_sequence,
    topk_scores)
from kiln.services.rollout.sampling import (logprobs_mode, sample_choice, sample_token, tempered_logits,
                                            tool_choice_row)

ENGINE_NAME = "megatron"


class MegatronEngine(EngineBase):
    def __init__(self, model: Any, spec: Any, settings: EngineSettings, eos_token_ids: set[int],
                 dsa_backend: DSABackend) -> None:
        import megatron.core

        dsa_desc = (f"dsa=topk{spec.dsa.index_topk}/h{spec.dsa.index_heads}/d{spec.dsa.index_dim}"
                    f"/{dsa_backend}" if spec.dsa else "dsa=off")
        super().__init__(settings, f"megatron-core-{megatron.core.__version__}+torch-"
                                   f"{torch.__version__};dtype={settings.dtype};"
                                   f"seed={settings.seed};{dsa_desc};logprobs={logprobs_mode(settings)}")
        self.model = model
        self.spec = spec
        self.eos_token_ids = eos_token_ids
        self.max_len = settings.max_model_len or spec.max_position_embeddings
        self._lock = asyncio.Lock()  # one decoding step or one weight update at a time
        self._seeds = random.Random(settings.seed)
        self._params = model_tensors(model)
        self._hf_names = {name for name, _ in iter_hf_tensors(model, spec)}

    @classmethod
    async def start(cls, settings: EngineSettings, dsa_backend: DSABackend = "auto") -> "MegatronEngine":
        """Load `settings.model`. Joins (or creates) this process's Megatron process group at
        tensor-parallel size 1, so it can share a process with a TP=1 trainer."""
        parallel.init_parallel(1, seed=settings.seed)
        model, spec = await asyncio.to_thread(
            load_hf_checkpoint, Path(settings.model), 1, getattr(torch, settings.dtype), "sdpa", dsa_backend)
        model.eval()
        return cls(model, spec, settings, _eos_token_ids(Path(settings.model)), dsa_backend)

    @torch.no_grad()
    def _step(self, tokens: list[int]) -> tuple[torch.Tensor, dict[int, torch.Tensor], list[torch.Tensor]]:
        """Last-row logits of a full forward pass over `tokens`, each DSA layer's indices, and
        each MoE layer's experts for every position ([] unless recording)."""
        ids = torch.tensor([tokens], dtype=torch.long, device=next(self.model.parameters()).device)
        with dsa.record_indices(self.model) as indices, moe.record_routing(self.model) as routing:
            logits = forward_logits(self.model, ids)
        return logits[0, -1], dict(indices), routing if self.settings.record_routing else []

    async def generate(self, prompt_token_ids: Sequence[int], sampling: SamplingOptions) -> Generation:
        if not prompt_token_ids:
            raise ValueError("prompt_token_ids must not be empty")
        if len(prompt_token_ids) >= self.max_len:
            raise ValueError(f"prompt of {len(prompt_token_ids)} tokens leaves no room under "
                             f"max_model_len={self.max_len}")
        bad = [t for t in prompt_token_ids if not 0 <= t < self.spec.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside [0, {self.spec.vocab_size})")
        seed = sampling.seed if sampling.seed is not None else self._seeds.getrandbits(63)
        gen = torch.Generator().manual_seed(seed)
        stops = self.eos_token_ids | set(sampling.stop_token_ids)
        tokens = list(prompt_token_ids)
        out, logps, versions = [], [], []
        indices: dict[int, torch.Tensor] = {}
        routed: list[torch.Tensor] = []
        finish = "length"
        for _ in range(min(sampling.max_tokens, self.max_len - len(tokens))):
            async with self._lock:
                version = self.policy_version
                logits, indices, routed = await asyncio.to_thread(self._step, tokens)
            logits = logits.float()
            if (row := tool_choice_row(logits, sampling, out)) is not None:
                token, logp = sample_choice(row, sampling, gen)
            else:
                token, _ = sample_token(logits, sampling, gen)
                # Megatron's cross entropy, row by row: the trainer's bits.
                logp = next_token_logprob(
                    tempered_logits(logits, sampling, self.settings.tempered_logprobs), token)
            logps.append(logp)
            tokens.append(token)
            out.append(token)
            versions.append(version)
            if token in stops:
                finish = "stop"
                break
        # The last step covered prompt + out[:-1], i.e. every row that predicted a token.
        hashes = dsa.sequence_hashes(indices, 0, len(tokens)) if indices else []
        # Only the last step's routing is kept: it covers every position, under the newest version.
        experts = (RoutedExperts.pack(moe.recorded_to_BSLK(routed, 1, len(tokens) - 1)[0].cpu().numpy(),
                                      self.spec.moe.num_experts, version=versions[-1]) if routed else None)
        return Generation(out, logps, versions, finish, index_hashes=hashes, routed_experts=experts)

    async def score(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
        out = []
        for seq in sequences:
            self._check(seq)
            async with self._lock:
                out.append(await asyncio.to_thread(self._score_one, list(seq)))
        return out

    def _check(self, seq: Sequence[int]) -> None:
        check_sequence(seq, self.spec.vocab_size)
        if len(seq) > self.max_len:
            raise ValueError(f"sequences: {len(seq)} tokens exceed max_model_len={self.max_len}")

    async def score_topk(self, sequences: Sequence[Sequence[int]], k: int) -> list[TopKScores]:
        out = []
        for seq in sequences:
            self._check(seq)
            async with self._lock:
                out.append(await asyncio.to_thread(self._score_topk_one, list(seq), k))
        return out

    @torch.no_grad()
    def _score_topk_one(self, seq: list[int], k: int) -> TopKScores:
        ids = torch.tensor([seq], dtype=torch.long, device=next(self.model.parameters()).device)
        logits = forward_logits(self.model, ids)[0, :-1].float()
        return topk_scores(seq, torch.log_softmax(logits, dim=-1), k)

    @torch.no_grad()
    def _score_one(self, seq: list[int]) -> list[float]:
        # The trainer's own function: a teacher scored here gives the trainer's numbers.
        ids = torch.tensor([seq], dtype=torch.long, device=next(self.model.parameters()).device)
        return token_logprobs(self.model, ids)[0].tolist()

    async def apply_weights(self, version: int, named_tensors: NamedTensors) -> None:
        """Load a complete set of HF-named weights as `version` (all or nothing)."""
        async with self._lock:
            self.check_new_version(version)
            hf = dict(named_tensors)
            unknown = sorted(set(hf) - self._hf_names)
            if unknown:
                raise ValueError(f"weights {unknown[:5]} are not weights of the model; old weights kept")
            try:
                mstate = hf_to_megatron_shard(hf, self.spec, 0, 1)
            except KeyError as e:
                raise ValueError(f"weights for version {version} lack {e.args[0]}; the megatron engine "
                                 "takes complete weight sets only; old weights kept") from None
            for name, t in mstate.items():
                p = self._params.get(name)
                if p is None or t.shape != p.shape:
                    raise ValueError(f"weight {name} has shape {tuple(t.shape)}, expected "
                                     f"{None if p is None else tuple(p.shape)}; old weights kept")
            await asyncio.to_thread(load_state_into, self.model, mstate)
            self._switched_to(version)

    async def close(self) -> None:
        self.model = None


def _eos_token_ids(model_dir: Path) -> set[int]:
    """End-of-sequence ids from generation_config.json, else config.json."""
    for name in ("generation_config.json", "config.json"):
        path = model_dir / name
        if path.exists():
            eos = json.loads(path.read_text()).get("eos_token_id")
            if eos is not None:
                return set(eos if isinstance(eos, list) else [eos])
    return set()
