"""What the agent loop needs from an inference engine, and the one factory that makes engines.

`Engine` is the protocol: `generate` (token ids in, sampled token ids with their log-probs and
policy versions out), `apply_weights` (a new policy version, in place, while generation goes
on), `policy_version` and `fingerprint`. Three implementations share `EngineBase`, which holds
the version and fingerprint state and the rule that versions only move forward:
- `vllm` (`vllm_engine.VllmEngine`): vLLM's AsyncLLM, the production engine;
- `megatron` (`megatron_engine.MegatronEngine`): the trainer's own model code, for DSA models
  (which vLLM cannot run on a CPU) and for bit-exact checks;
- `torch` (`torch_engine.TorchEngine`): a plain transformers model, starting in a second, for
  tests.
`start_engine(kind, settings)` starts one; `engine_kind(spec_engine, model_dir)` is the choice
rollout and `kiln consistency` both make.

The version guarantee every engine keeps: each generated token is tagged with the version of
the weights that produced it, and its log-prob is that version's log-prob of the token given the
whole preceding sequence. A request may carry several versions; they never decrease.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Literal, Protocol, Sequence

from pydantic import BaseModel, ConfigDict, Field

from kiln.api.capabilities import rollout_engine
from kiln.api.model_families import is_dsa_config
from kiln.routing import RoutedExperts

if TYPE_CHECKING:
    import torch

    from kiln.api.spec import RLJob

NamedTensors = Iterable[tuple[str, "torch.Tensor"]]
EngineKind = Literal["vllm", "megatron", "torch"]
ENGINE_KINDS: tuple[str, ...] = ("vllm", "megatron", "torch")


@dataclass(frozen=True)
class ToolChoiceRule:
    """Where a reply chooses among known tokens: each of `choices` is (opening, token ids,
    temperature): the token right after `opening` (as generated in this request; an empty
    opening: the request's first token) is sampled at that temperature from those token ids
    alone, and its log-prob recorded under that distribution. The agent loop makes them from
    the format and the episode's tools: after a call's opening, the first tokens of the tools'
    names at `toolChoiceTemperature`; at the request's own temperature, a reply's first token
    (call or answer) and, after each further token of a call whose argument is enumerated,
    the tokens that keep it one of the schema's calls (the closing tag, after a whole value: a
    choice of one). A greedy request takes the argmax among them. The rest of the reply is
    sampled as usual."""

    choices: tuple[tuple[tuple[int, ...], tuple[int, ...], float], ...]

    def allowed(self, generated: Sequence[int], end: int | None = None
                ) -> tuple[tuple[int, ...], float] | None:
        """(the tokens the next one is chosen among, at what temperature), after `generated`
        (this request's tokens so far; its first `end` when given); None where it is no
        choice. The longest opening that matches wins."""
        end = len(generated) if end is None else end
        best = None
        for opening, token_ids, temperature in self.choices:
            n = len(opening)
            if (end >= n and all(generated[end - n + j] == t for j, t in enumerate(opening))
                    and (n or not end) and (best is None or n > len(best[0]))):
                best = (opening, token_ids, temperature)
        return (best[1], best[2]) if best is not None else None

    def positions(self, generated: Sequence[int]) -> list[tuple[int, tuple[int, ...], float]]:
        """(index into `generated`, the tokens it was chosen among, the temperature) of each
        choice."""
        return [(i, *found) for i in range(len(generated))
                if (found := self.allowed(generated, i)) is not None]


@dataclass(frozen=True)
class SamplingOptions:
    temperature: float = 1.0
    """0 means greedy."""
    top_p: float = 1.0
    max_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()
    """Generation also stops at the model's end-of-sequence token(s); the stop token is kept."""
    seed: int | None = None
    """Per-request seed; None draws from the engine's seeded stream. On a CPU, vLLM 0.32 kills
    its engine ("CPU Generator does not use offset") when a seeded request's prefill is split
    over several steps, which happens once many long prompts are in flight: rollout and
    evaluation therefore leave it unset, and the OpenAI endpoint drops its clients' seeds where
    the engine's `honours_seeds` is false; short single prompts (tests, `kiln consistency`) are safe."""
    tool_choice_temperature: float | None = None
    """The job's `sampling.toolChoiceTemperature`: the agent loop makes each request's
    `tool_choice` from it and the episode's tools."""
    tool_choice: ToolChoiceRule | None = None
    """This request's tool-choice rule (see ToolChoiceRule), if any."""

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"sampling.temperature={self.temperature} must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"sampling.top_p={self.top_p} must be in (0, 1]")
        if self.max_tokens < 1:
            raise ValueError(f"sampling.max_tokens={self.max_tokens} must be >= 1")


@dataclass
class Generation:
    token_ids: list[int]
    logprobs: list[float]
    """Log-prob of each sampled token under the raw model distribution (before temperature or
    top-p), or with `EngineSettings.tempered_logprobs` under softmax(logits / temperature), as
    the trainer computes it."""
    versions: list[int]
    """Policy version of each sampled token (non-decreasing)."""
    finish_reason: str
    """"stop" (a stop or end-of-sequence token, included in token_ids), "length" or "abort"."""
    index_hashes: list[int] = field(default_factory=list)
    """DSA models only (engine `megatron`): one `kiln.kernels.dsa.index_hash` per attention layer
    of the top-k indices selected for prompt + token_ids[:-1] under the last token's version,
    which the trainer recomputes to detect a different selection. Empty for other engines."""
    routed_experts: "RoutedExperts | None" = None
    """MoE models, when the engine records routing: the experts chosen for token positions
    `[start, len(prompt) + len(token_ids) - 1)` of prompt + token_ids (every position that
    predicted a sampled token; position 0 is the prompt's first). None otherwise."""


TopKScores = tuple[list[float], list[int], list[float]]
"""A sequence scored with its top k: (log-prob of each token, the k most likely ids in each
place, their log-probs), the last two k entries per token."""


def topk_scores(seq: Sequence[int], logp_SV, k: int) -> TopKScores:
    """`TopKScores` of `seq` from the log-softmax `[len(seq) - 1, V]` of the positions that
    predict tokens 1.. (a torch tensor). Ties are broken towards the lower id."""
    import torch

    tokens = torch.tensor(list(seq[1:]), dtype=torch.long, device=logp_SV.device)
    sampled = logp_SV.gather(1, tokens[:, None])[:, 0]
    vals, ids = torch.topk(logp_SV, k, dim=-1, sorted=True)
    return ([0.0, *sampled.tolist()], [0] * k + ids.flatten().tolist(),
            [0.0] * k + vals.flatten().tolist())


class Engine(Protocol):
    @property
    def policy_version(self) -> int:
        """The policy version new tokens are sampled under."""

    @property
    def fingerprint(self) -> str:
        """Engine build and the settings that decide its numerics (recorded per trajectory)."""

    async def generate(self, prompt_token_ids: Sequence[int], sampling: SamplingOptions) -> Generation:
        ...

    async def score(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
        """Per-token log-probs of each sequence under the weights served: entry t is
        log p(token t | tokens < t) of the raw distribution, entry 0 is 0.0."""
        ...

    async def score_topk(self, sequences: Sequence[Sequence[int]], k: int) -> list[TopKScores]:
        """`score`, and the k most likely tokens in each place with their log-probs (entry
        t*k+j: the j-th most likely in place of token t; position 0's entries are 0)."""
        ...

    async def apply_weights(self, version: int, named_tensors: NamedTensors) -> None:
        """Switch to policy `version` (Hugging Face tensor names), which must be newer."""

    async def close(self) -> None:
        ...


class EngineSettings(BaseModel):
    """How an engine is started; `from_job` fills it from an RLJob."""

    model_config = ConfigDict(extra="forbid")
    model: str = Field(min_length=1)
    """Hugging Face checkpoint directory."""
    dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    kv_cache_bytes: int = Field(1 << 30, ge=1 << 20)
    enforce_eager: bool = True
    seed: int = 0
    max_model_len: int | None = Field(None, ge=16)
    """Defaults to the model's max_position_embeddings."""
    initial_version: int = Field(0, ge=0)
    """Policy version of the checkpoint in `model`."""
    record_routing: bool = False
    """MoE models: return the experts chosen per token (`Generation.routed_experts`), for
    routing replay in the trainer. Ignored for dense models."""
    tempered_logprobs: bool = False
    """Record each sampled token's log-prob under softmax(logits / temperature), the
    distribution it was drawn from, instead of under the raw logits (greedy requests keep the
    raw ones). On for a policy whose job samples at a temperature other than 0 or 1, so its
    log-probs match the trainer's (`SamplingSpec.temperature`); scoring is always raw."""
    lora_scaling: float | None = None
    """A LoRA policy (`spec.model.lora`): alpha / rank. Versions then carry only the adapter,
    merged into the base weights of `model` before each reload (`lora_merge.py`)."""

    @classmethod
    def from_job(cls, job: "RLJob", model_dir: str | None = None, **overrides: Any) -> "EngineSettings":
        spec = job.spec
        return cls(**{"model": model_dir or str(spec.model.local_path()), "dtype": spec.model.dtype,
                      "kv_cache_bytes": spec.rollout.kv_cache_bytes,
                      "enforce_eager": spec.rollout.enforce_eager, "seed": spec.seed,
                      "record_routing": spec.model.routing_replay != "off",
                      "tempered_logprobs": spec.rollout.sampling.processed_logprobs,
                      "lora_scaling": spec.model.lora.scaling if spec.model.lora else None, **overrides})


def check_sequence(seq: Sequence[int], vocab_size: int) -> None:
    """ValueError unless `seq` is a non-empty sequence of token ids below `vocab_size`."""
    if not seq:
        raise ValueError("sequences: an empty sequence has nothing to score")
    bad = [t for t in seq if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"sequences: token ids {bad[:5]} are outside [0, {vocab_size})")


class EngineBroken(RuntimeError):
    """The engine's weights are in an unknown state (a reload failed part-way): it must not
    generate again. The rollout service exits so that it is restarted, loads its model afresh
    and takes the latest version whole from weight-sync."""


class EngineBase:
    """The state every engine keeps: its settings, the policy version new tokens get, and the
    fingerprint recorded on every trajectory."""

    def __init__(self, settings: EngineSettings, fingerprint: str) -> None:
        self.settings = settings
        self._policy_version = settings.initial_version
        self._fingerprint = fingerprint

    @property
    def policy_version(self) -> int:
        return self._policy_version

    @property
    def fingerprint(self) -> str:
        return self._fingerprint

    #: Whether a request's `SamplingOptions.seed` is safe to pass (see `SamplingOptions.seed`).
    honours_seeds = True

    def failure(self) -> str:
        """Why this engine can no longer generate ("" while it can)."""
        return ""

    def check_new_version(self, version: int) -> None:
        """ValueError unless `version` is newer than the one being served."""
        if version <= self._policy_version:
            raise ValueError(
                f"version={version} is not newer than the engine's version {self._policy_version}; "
                "versions only move forward (retrying the same version will not help)")

    def _switched_to(self, version: int) -> None:
        """Record that the weights of `version` are in place (call once they are)."""
        self._policy_version = version


def is_dsa_checkpoint(model_dir: str | Path) -> bool:
    config = Path(model_dir) / "config.json"
    return config.exists() and is_dsa_config(json.loads(config.read_text()))


def engine_kind(requested: str, model_dir: str | Path) -> EngineKind:
    """The engine to run: `requested` ("auto", or one of ENGINE_KINDS), with "auto" and "vllm"
    meaning megatron for a DSA checkpoint, which vLLM has no CPU path for."""
    if requested not in ("auto", *ENGINE_KINDS):
        raise ValueError(f"engine={requested!r} is not one of {('auto', *ENGINE_KINDS)}")
    config = Path(model_dir) / "config.json"
    return rollout_engine(requested, json.loads(config.read_text()) if config.exists() else {})  # type: ignore[return-value]


async def start_engine(kind: EngineKind, settings: EngineSettings, **options: Any) -> Engine:
    """Start an engine of `kind` on `settings.model` (`options` go to its `start`, e.g. the
    megatron engine's `dsa_backend`), merging LoRA versions into its base where
    `settings.lora_scaling` is set. ValueError for an unknown kind."""
    if settings.lora_scaling is not None:
        from kiln.services.rollout.lora_merge import AdapterMergingEngine

        inner = await start_engine(kind, settings.model_copy(update={"lora_scaling": None}), **options)
        return AdapterMergingEngine(inner, settings.model, settings.lora_scaling)  # type: ignore[return-value]
    if kind == "vllm":
        from kiln.services.rollout.vllm_engine import VllmEngine
        return await VllmEngine.start(settings, **options)
    if kind == "megatron":
        from kiln.services.rollout.megatron_engine import MegatronEngine
        return await MegatronEngine.start(settings, **options)
    if kind == "torch":
        from kiln.services.rollout.torch_engine import TorchEngine
        return await TorchEngine.start(settings, **options)
    raise ValueError(f"engine kind {kind!r} is not one of {ENGINE_KINDS}")
