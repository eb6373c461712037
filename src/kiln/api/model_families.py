"""The model families Kiln trains and serves: one declarative entry per architecture family.

An entry (`Family`) says everything the rest of Kiln needs to know about a family, as data:
- which Hugging Face `architectures` names it (config.json);
- how the trainer builds it: its `Attention` (grouped-query, q/k RMSNorm per head, qkv bias) and,
  for a mixture of experts, its `MoE` (where config.json keeps the expert count, top-k and expert
  width; the score function; `norm_topk_prob`; a shared expert and its gate; which config fields
  make some layers dense);
- how its weights map between Hugging Face and Megatron-core names (`WeightTable`, one table
  read in both directions by `kiln.models.hf_io`'s loader and its streaming iterator);
- which tensor-parallel splits it allows, and which rollout engines serve it on which hardware;
- which config.json fields must keep their default, because the model code does not build
  what another value means (each refusal names the field).

Torch-free, so the capability table (`kiln.api.capabilities`) and `kiln validate` read the same
entries the model code (`kiln.models`) builds from. Features that a later family needs and the
model code does not build yet (MLA attention, sigmoid routing, an expert score bias, a routed
scaling factor, expert groups, dense first layers) have fields here; an entry that sets them is
refused with one line naming them (`Family.unbuilt`). The README's supported-models table is
`supported_models_table()`; a test keeps the two equal.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

WeightKind = Literal["copy", "column", "row", "qkv", "gate_up"]
"""How one Megatron tensor is made of its HF tensor(s), and how tensor parallelism splits it:
`copy` one to one, replicated; `column` one to one, rows split over ranks; `row` one to one,
columns split; `qkv` q, k and v fused per KV group (rows split: whole groups per rank); `gate_up`
gate and up stacked per rank (each rank holds its gate rows, then its up rows)."""
ENGINES = ("vllm", "megatron", "torch")


@dataclass(frozen=True)
class Weight:
    """One row of a weight table: a Megatron parameter and the HF tensor(s) it is made of.
    Names may hold `{e}` (the expert index); `when` names a flag of the built model
    (`WeightTable.rows`) without which the row does not exist."""

    megatron: str
    hf: tuple[str, ...]
    kind: WeightKind = "copy"
    when: str | None = None


def _w(megatron: str, hf: str | tuple[str, ...], kind: WeightKind = "copy", when: str | None = None) -> Weight:
    return Weight(megatron, (hf,) if isinstance(hf, str) else hf, kind, when)


@dataclass(frozen=True)
class WeightTable:
    """Megatron <-> HF names. `model` rows are whole names; `layer`, `dense_mlp` and `moe` rows
    are under `decoder.layers.{i}.` / `model.layers.{i}.`; `expert` rows are per expert."""

    model: tuple[Weight, ...]
    layer: tuple[Weight, ...]
    dense_mlp: tuple[Weight, ...]
    moe: tuple[Weight, ...] = ()
    expert: tuple[Weight, ...] = ()

    @staticmethod
    def rows(rows: tuple[Weight, ...], flags: set[str]) -> list[Weight]:
        """The rows that exist in a model with `flags` (e.g. {"qkv_bias", "untied"})."""
        return [r for r in rows if r.when is None or r.when in flags]


_QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")

LLAMA_NAMES = WeightTable(
    model=(
        _w("embedding.word_embeddings.weight", "model.embed_tokens.weight", "column"),
        _w("decoder.final_layernorm.weight", "model.norm.weight"),
        _w("output_layer.weight", "lm_head.weight", "column", when="untied"),
    ),
    layer=(
        _w("input_layernorm.weight", "input_layernorm.weight"),
        _w("self_attention.linear_qkv.weight", tuple(f"{p}.weight" for p in _QKV), "qkv"),
        _w("self_attention.linear_qkv.bias", tuple(f"{p}.bias" for p in _QKV), "qkv", when="qkv_bias"),
        _w("self_attention.q_layernorm.weight", "self_attn.q_norm.weight", when="qk_layernorm"),
        _w("self_attention.k_layernorm.weight", "self_attn.k_norm.weight", when="qk_layernorm"),
        _w("self_attention.linear_proj.weight", "self_attn.o_proj.weight", "row"),
        # Kiln's DeepSeek-sparse-attention indexer (config.json `kiln_dsa`), replicated.
        *(_w(f"self_attention.indexer.{n}.weight", f"self_attn.indexer.{n}.weight", when="dsa")
          for n in ("wq", "wk", "weights_proj")),
        _w("pre_mlp_layernorm.weight", "post_attention_layernorm.weight"),
    ),
    dense_mlp=(
        _w("mlp.linear_fc1.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight"), "gate_up"),
        _w("mlp.linear_fc2.weight", "mlp.down_proj.weight", "row"),
    ),
    moe=(
        _w("mlp.router.weight", "mlp.gate.weight"),
        _w("mlp.shared_experts.linear_fc1.weight",
           ("mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.up_proj.weight"), "gate_up",
           when="shared_expert"),
        _w("mlp.shared_experts.linear_fc2.weight", "mlp.shared_expert.down_proj.weight", "row",
           when="shared_expert"),
        _w("mlp.shared_experts.gate_weight", "mlp.shared_expert_gate.weight", when="shared_expert_gate"),
    ),
    expert=(
        _w("mlp.experts.local_experts.{e}.linear_fc1.weight",
           ("mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight"), "gate_up"),
        _w("mlp.experts.local_experts.{e}.linear_fc2.weight", "mlp.experts.{e}.down_proj.weight", "row"),
    ),
)
"""The Llama layout, shared by Qwen2, Qwen3 and their MoE variants (per-expert hub names, which
are also the names vLLM loads)."""


@dataclass(frozen=True)
class Attention:
    kind: Literal["gqa", "mla"] = "gqa"
    """Grouped-query attention (heads, KV heads, `head_dim`); "mla" is not built yet."""
    qkv_bias: bool = False
    qkv_bias_field: str | None = None
    """A config.json field that overrides `qkv_bias` when present (Qwen2-MoE: "qkv_bias")."""
    qk_layernorm: bool = False
    """RMSNorm over each head of q and k, before RoPE (Qwen3)."""

    def bias(self, config: dict[str, Any]) -> bool:
        return bool(config.get(self.qkv_bias_field, self.qkv_bias)) if self.qkv_bias_field else self.qkv_bias


@dataclass(frozen=True)
class MoE:
    """Where a MoE family's config.json keeps its routing, and what the routing is."""

    num_experts: tuple[str, ...] = ("num_experts",)
    """Fields that may hold the expert count; the first present wins."""
    topk: str = "num_experts_per_tok"
    ffn: str = "moe_intermediate_size"
    score: Literal["softmax", "sigmoid"] = "softmax"
    """Softmax over all experts, then top-k; "sigmoid" (DeepSeek-V3, GLM-4.5) is not built yet."""
    norm_topk_prob: bool = False
    """When config.json does not say: renormalise the k chosen weights to sum to 1."""
    shared_expert: str | None = None
    """The field with the shared expert's width (0 or absent: none); None: the family has none."""
    shared_expert_gate: bool = False
    """The shared expert's output is scaled by sigmoid(gate(x))."""
    sparse_step: str | None = None
    """A field making only every n-th layer sparse (Qwen's `decoder_sparse_step`)."""
    dense_list: str | None = None
    """A field listing dense layers (Qwen's `mlp_only_layers`)."""
    first_dense: str | None = None
    """A field giving a number of dense first layers (DeepSeek's `first_k_dense_replace`); not built yet."""
    expert_bias: bool = False
    """A per-expert score bias for selection (DeepSeek-V3 `noaux_tc`); not built yet."""
    routed_scaling: str | None = None
    """A field scaling the routed experts' output (`routed_scaling_factor`); not built yet."""
    expert_groups: tuple[str, str] | None = None
    """Fields of group-limited routing (`n_group`, `topk_group`); not built yet."""

    def experts(self, config: dict[str, Any]) -> int | None:
        return next((config[f] for f in self.num_experts if config.get(f) is not None), None)

    def shared_width(self, config: dict[str, Any]) -> int:
        return (config.get(self.shared_expert) or 0) if self.shared_expert else 0

    def dense_layers(self, config: dict[str, Any]) -> list[int]:
        """The layers config.json makes dense (Qwen's rule: sparse iff not in the list and
        (i + 1) divisible by the step)."""
        step = (config.get(self.sparse_step) or 1) if self.sparse_step else 1
        dense = set(config.get(self.dense_list) or []) if self.dense_list else set()
        return [i for i in range(config.get("num_hidden_layers", 0)) if i in dense or (i + 1) % step]


@dataclass(frozen=True)
class Rollout:
    """Rollout engines that serve the family in a run, per hardware; the first is what
    `rollout.engine: auto` (and a refused `vllm`) picks."""

    cpu: tuple[str, ...] = ENGINES
    gpu: tuple[str, ...] = ENGINES
    note: str = ""
    """Why an engine is missing."""


@dataclass(frozen=True)
class Family:
    name: str
    """Kiln's name (`make_tiny_model(arch=...)`, `ArchSpec.arch`)."""
    title: str
    architectures: tuple[str, ...]
    attention: Attention
    weights: WeightTable = LLAMA_NAMES
    moe: MoE | None = None
    max_tensor_parallel: int | None = None
    """None: any split that divides heads, KV heads, vocabulary and MLP width."""
    rollout: Rollout = Rollout()
    dsa: bool = False
    """Whether a `kiln_dsa` config entry (DeepSeek sparse attention) may be added."""
    defaults_only: tuple[tuple[str, Any], ...] = ()
    """config.json fields the model code builds only at this value (absent counts as it)."""

    def unbuilt(self) -> list[str]:
        """Features of this entry that the model code does not build yet."""
        a, m = self.attention, self.moe
        out = ["MLA attention (attention.kind)"] if a.kind != "gqa" else []
        if m is not None:
            out += [what for what, on in (
                ("sigmoid routing (moe.score)", m.score != "softmax"),
                ("an expert score bias (moe.expert_bias)", m.expert_bias),
                ("routed scaling (moe.routed_scaling)", m.routed_scaling is not None),
                ("expert groups (moe.expert_groups)", m.expert_groups is not None),
                ("dense first layers (moe.first_dense)", m.first_dense is not None)) if on]
        return out


_COMMON = (("hidden_act", "silu"), ("use_sliding_window", False))

QWEN2 = Family(
    name="qwen2", title="Qwen2", architectures=("Qwen2ForCausalLM",),
    attention=Attention(qkv_bias=True), dsa=True, defaults_only=_COMMON,
)
LLAMA = Family(
    name="llama", title="Llama", architectures=("LlamaForCausalLM",),
    attention=Attention(), dsa=True,
    # HF Llama's attention_bias also gives o_proj a bias, which the Megatron layers lack.
    defaults_only=(*_COMMON, ("attention_bias", False), ("mlp_bias", False)),
)
_MOE_ROLLOUT = Rollout(
    cpu=("megatron", "torch"), gpu=("megatron", "torch"),
    note="vLLM 0.32 serves it, but returns routed experts only from its GPU-only V2 runner and "
         "leaves reloaded expert weights unpacked on CPUs")
QWEN2_MOE = Family(
    name="qwen2_moe", title="Qwen2-MoE", architectures=("Qwen2MoeForCausalLM",),
    attention=Attention(qkv_bias=True, qkv_bias_field="qkv_bias"),
    moe=MoE(shared_expert="shared_expert_intermediate_size", shared_expert_gate=True,
            sparse_step="decoder_sparse_step", dense_list="mlp_only_layers"),
    max_tensor_parallel=1, rollout=_MOE_ROLLOUT, dsa=True, defaults_only=_COMMON,
)
QWEN3 = Family(
    name="qwen3", title="Qwen3", architectures=("Qwen3ForCausalLM",),
    attention=Attention(qk_layernorm=True),
    defaults_only=(*_COMMON, ("attention_bias", False)),
)
QWEN3_MOE = Family(
    name="qwen3_moe", title="Qwen3-MoE", architectures=("Qwen3MoeForCausalLM",),
    attention=Attention(qk_layernorm=True),
    # transformers 5 writes `num_local_experts`, the hub's checkpoints `num_experts`.
    moe=MoE(num_experts=("num_experts", "num_local_experts"), sparse_step="decoder_sparse_step",
            dense_list="mlp_only_layers"),
    max_tensor_parallel=1, rollout=_MOE_ROLLOUT,
    defaults_only=(*_COMMON, ("attention_bias", False)),
)

FAMILIES: tuple[Family, ...] = (QWEN2, LLAMA, QWEN2_MOE, QWEN3, QWEN3_MOE)
BY_NAME = {f.name: f for f in FAMILIES}
BY_ARCHITECTURE = {a: f for f in FAMILIES for a in f.architectures}
SUPPORTED_ARCHS = {a: f.name for a, f in BY_ARCHITECTURE.items()}
"""Hugging Face architecture -> family name."""


def family_of(config: dict[str, Any]) -> Family | None:
    """The family of a config.json (its first known `architectures` entry), or None."""
    return next((BY_ARCHITECTURE[a] for a in config.get("architectures") or [] if a in BY_ARCHITECTURE), None)


def config_problems(config: dict[str, Any], families: tuple[Family, ...] = FAMILIES) -> list[str]:
    """One line per reason the model code cannot build this config.json (each naming a field);
    empty when it can."""
    archs = config.get("architectures") or []
    family = next((f for a in archs for f in families if a in f.architectures), None)
    if family is None:
        names = sorted(a for f in families for a in f.architectures)
        return [f"architecture {', '.join(archs) or '(none)'} is not supported; the trainer builds "
                f"{', '.join(names)}"]
    if unbuilt := family.unbuilt():
        return [f"architecture {', '.join(archs)} ({family.title}) is not supported yet: Kiln does not "
                f"build {', '.join(unbuilt)}"]
    problems = [f"config.json {name}={config[name]!r}: {family.title} is built with {name}={value!r} only"
                for name, value in family.defaults_only if config.get(name, value) != value]
    scaling = config.get("rope_scaling")
    if scaling and scaling.get("rope_type", scaling.get("type")) not in (None, "default"):
        problems.append(f"config.json rope_scaling={scaling}: RoPE scaling is not supported")
    if config.get("kiln_dsa") is not None and not family.dsa:
        problems.append(f"config.json kiln_dsa: DeepSeek sparse attention is not built for {family.title}")
    if (m := family.moe) is not None:
        problems += _moe_problems(config, family.title, m)
    return problems


def _moe_problems(config: dict[str, Any], title: str, m: MoE) -> list[str]:
    num, k = m.experts(config), config.get(m.topk)
    if num is None or k is None or config.get(m.ffn) is None:
        return [f"config.json lacks {' or '.join(m.num_experts)}, {m.topk} or {m.ffn} ({title})"]
    problems = [] if 1 <= k <= num else [f"config.json {m.topk}={k} must be in [1, {'/'.join(m.num_experts)}={num}]"]
    if dense := m.dense_layers(config):
        fields = [f for f in (m.sparse_step, m.dense_list) if f]
        problems.append(
            f"config.json {' '.join(f'{f}={config.get(f)!r}' for f in fields)}: layers {dense} are dense; "
            f"only {title} models whose every layer is sparse are supported")
    return problems


def supported_models_table() -> str:
    """The README's supported-models table (markdown), generated from the entries."""
    lines = ["| architecture | family | rollout engines (CPU / GPU) | tensor parallel | routing replay | DSA |",
             "| --- | --- | --- | --- | --- | --- |"]
    for f in FAMILIES:
        engines = (", ".join(f.rollout.cpu) if f.rollout.cpu == f.rollout.gpu
                   else f"{', '.join(f.rollout.cpu)} / {', '.join(f.rollout.gpu)}")
        tp = "any that divides the heads" if f.max_tensor_parallel is None else f"{f.max_tensor_parallel} only"
        for arch in f.architectures:
            lines.append(f"| `{arch}` | {f.title} | {engines} | {tp} | "
                         f"{'yes' if f.moe else 'n/a (dense)'} | {'yes' if f.dsa else 'no'} |")
    return "\n".join(lines)
