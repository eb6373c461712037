"""The model families Kiln trains and serves: one declarative entry per architecture family.

An entry (`Family`) says everything the rest of Kiln needs to know about a family, as data:
- which Hugging Face `architectures` names it (config.json);
- how the trainer builds it: its `Attention` (grouped-query with q/k RMSNorm per head, qkv bias
  and partial RoPE, or multi-latent) and, for a mixture of experts, its `MoE` (where config.json
  keeps the expert count, top-k and expert width; softmax or sigmoid scores; `norm_topk_prob`;
  a selection bias; routed scaling; expert groups; shared experts and their gate; which config
  fields make some layers dense);
- how its weights map between Hugging Face and Megatron-core names (a `WeightTable` of
  `kiln.api.weight_tables`, read in both directions by `kiln.models.hf_io`);
- which tensor-parallel splits it allows, and which rollout engines serve it on which hardware;
- which config.json fields must keep their default, because the model code does not build
  what another value means (each refusal names the field).

Torch-free, so the capability table (`kiln.api.capabilities`) and `kiln validate` read the same
entries the model code (`kiln.models`) builds from: family-specific behaviour is a field here,
read by the shared model code, never a branch on a family's name there. The supported-models
table of the model guide (`docs/guides/your-model.md`) is `supported_models_table()`; a test
keeps the two equal.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from kiln.api.weight_tables import DEEPSEEK_MOE_NAMES, LLAMA_NAMES, MLA_NAMES, WeightTable

ENGINES = ("vllm", "megatron", "torch")


@dataclass(frozen=True)
class Attention:
    kind: Literal["gqa", "mla"] = "gqa"
    """Grouped-query attention (heads, KV heads, `head_dim`), or multi-latent attention
    (DeepSeek-V3's `q_lora_rank`, `kv_lora_rank`, `qk_{nope,rope}_head_dim`, `v_head_dim`)."""
    qkv_bias: bool = False
    qkv_bias_field: str | None = None
    """A config.json field that overrides `qkv_bias` when present (Qwen2-MoE: "qkv_bias")."""
    qk_layernorm: bool = False
    """RMSNorm over each head of q and k, before RoPE (Qwen3)."""
    qk_layernorm_field: str | None = None
    """A config.json field that overrides `qk_layernorm` when present (GLM-4.5: "use_qk_norm")."""
    rope_scaling: tuple[str, ...] = ()
    """RoPE scaling types (`rope_type` of `rope_scaling`/`rope_parameters`) the model code builds
    for this family (DeepSeek-V3's MLA: "yarn"); any other is refused."""
    rotary_fraction: str | None = None
    """A field giving the share of each head's dimensions that RoPE rotates (GLM-4.5's
    `partial_rotary_factor`, at the top level or in `rope_parameters`); None: all of them."""

    def bias(self, config: dict[str, Any]) -> bool:
        return bool(config.get(self.qkv_bias_field, self.qkv_bias)) if self.qkv_bias_field else self.qkv_bias

    def qk_norm(self, config: dict[str, Any]) -> bool:
        if self.qk_layernorm_field is None:
            return self.qk_layernorm
        return bool(config.get(self.qk_layernorm_field, self.qk_layernorm))

    def rotary_percent(self, config: dict[str, Any]) -> float:
        if self.rotary_fraction is None:
            return 1.0
        value = config.get(self.rotary_fraction, (config.get("rope_parameters") or {}).get(self.rotary_fraction))
        return 1.0 if value is None else float(value)


@dataclass(frozen=True)
class MoE:
    """Where a MoE family's config.json keeps its routing, and what the routing is."""

    num_experts: tuple[str, ...] = ("num_experts",)
    """Fields that may hold the expert count; the first present wins."""
    topk: str = "num_experts_per_tok"
    ffn: str = "moe_intermediate_size"
    score: Literal["softmax", "sigmoid"] = "softmax"
    """Softmax over all experts, then top-k; "sigmoid" (DeepSeek-V3, GLM-4.5): a sigmoid per
    expert, top-k, then the k weights renormalised (Megatron always renormalises sigmoid scores,
    so such a family needs `norm_topk_prob` true)."""
    norm_topk_prob: bool = False
    """When config.json does not say: renormalise the k chosen weights to sum to 1."""
    shared_expert: str | None = None
    """The field with the shared expert's width (0 or absent: none); None: the family has none."""
    shared_expert_count: str | None = None
    """A field counting shared experts of `ffn` width each, fused into one (DeepSeek's
    `n_shared_experts`); used when `shared_expert` is None."""
    shared_expert_gate: bool = False
    """The shared expert's output is scaled by sigmoid(gate(x))."""
    sparse_step: str | None = None
    """A field making only every n-th layer sparse (Qwen's `decoder_sparse_step`)."""
    dense_list: str | None = None
    """A field listing dense layers (Qwen's `mlp_only_layers`)."""
    first_dense: str | None = None
    """A field giving a number of dense first layers (DeepSeek's `first_k_dense_replace`), built
    with the dense MLP of `intermediate_size`."""
    expert_bias: bool = False
    """A per-expert score bias added for selection only (DeepSeek-V3's and GLM-4.5's
    `e_score_correction_bias`); the weights stay the unbiased scores."""
    routed_scaling: str | None = None
    """A field scaling the routed experts' weights (`routed_scaling_factor`)."""
    expert_groups: tuple[str, str] | None = None
    """Fields of group-limited routing (`n_group`, `topk_group`): experts in `n_group` equal
    groups, each ranked by the sum of its 2 best biased scores, top-k only within the best
    `topk_group` groups."""

    def experts(self, config: dict[str, Any]) -> int | None:
        return next((config[f] for f in self.num_experts if config.get(f) is not None), None)

    def shared_width(self, config: dict[str, Any]) -> int:
        if self.shared_expert:
            return config.get(self.shared_expert) or 0
        if self.shared_expert_count:
            return (config.get(self.shared_expert_count) or 0) * (config.get(self.ffn) or 0)
        return 0

    def groups(self, config: dict[str, Any]) -> tuple[int, int] | None:
        """(groups, groups kept) when routing is group-limited; None for one group."""
        if self.expert_groups is None:
            return None
        n, k = (config.get(f) or 1 for f in self.expert_groups)
        return None if n == 1 else (n, k)

    def scaling(self, config: dict[str, Any]) -> float | None:
        value = config.get(self.routed_scaling) if self.routed_scaling else None
        return None if value in (None, 1, 1.0) else float(value)

    def dense_layers(self, config: dict[str, Any]) -> list[int]:
        """The layers config.json makes dense (Qwen's rule: sparse iff not in the list and
        (i + 1) divisible by the step; DeepSeek's: the first `first_dense`)."""
        step = (config.get(self.sparse_step) or 1) if self.sparse_step else 1
        dense = set(config.get(self.dense_list) or []) if self.dense_list else set()
        first = (config.get(self.first_dense) or 0) if self.first_dense else 0
        return [i for i in range(config.get("num_hidden_layers", 0))
                if i < first or i in dense or (i + 1) % step]


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
    sparse_attention: tuple[str, str, str] | None = None
    """config.json fields (top-k, indexer heads, indexer head size) of DeepSeek sparse attention
    built into every layer of the family (DeepSeek-V3.2's `index_topk`, `index_n_heads`,
    `index_head_dim`); None: the family's attention is dense."""
    defaults_only: tuple[tuple[str, Any], ...] = ()
    """config.json fields the model code builds only at this value (absent counts as it)."""


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

GLM4_MOE = Family(
    name="glm4_moe", title="GLM-4.5 MoE", architectures=("Glm4MoeForCausalLM",),
    attention=Attention(qkv_bias_field="attention_bias", qk_layernorm_field="use_qk_norm",
                        rotary_fraction="partial_rotary_factor"),
    # transformers writes both `n_routed_experts` and its alias `num_local_experts`.
    moe=MoE(num_experts=("n_routed_experts", "num_local_experts"), score="sigmoid", norm_topk_prob=True,
            shared_expert_count="n_shared_experts", first_dense="first_k_dense_replace",
            expert_bias=True, routed_scaling="routed_scaling_factor",
            expert_groups=("n_group", "topk_group")),
    weights=DEEPSEEK_MOE_NAMES, max_tensor_parallel=1, rollout=_MOE_ROLLOUT,
    defaults_only=(("hidden_act", "silu"),),
)

DEEPSEEK_V3 = Family(
    name="deepseek_v3", title="DeepSeek-V3", architectures=("DeepseekV3ForCausalLM",),
    # qk_layernorm: the q and kv latent RMSNorms.
    attention=Attention(kind="mla", qk_layernorm=True, rope_scaling=("yarn",)),
    moe=MoE(num_experts=("n_routed_experts", "num_local_experts"), score="sigmoid", norm_topk_prob=True,
            shared_expert_count="n_shared_experts", first_dense="first_k_dense_replace",
            expert_bias=True, routed_scaling="routed_scaling_factor",
            expert_groups=("n_group", "topk_group")),
    weights=MLA_NAMES, max_tensor_parallel=1,
    rollout=Rollout(cpu=("megatron", "torch"), gpu=("megatron", "torch"), note=_MOE_ROLLOUT.note),
    # Megatron's MLA applies RoPE interleaved, DeepSeek's way, and has no projection biases.
    defaults_only=(("hidden_act", "silu"), ("rope_interleave", True), ("attention_bias", False)),
)

DEEPSEEK_V32 = Family(
    name="deepseek_v32", title="DeepSeek-V3.2", architectures=("DeepseekV32ForCausalLM",),
    attention=DEEPSEEK_V3.attention, moe=DEEPSEEK_V3.moe, weights=MLA_NAMES, max_tensor_parallel=1,
    rollout=Rollout(cpu=("megatron",), gpu=("megatron",),
                    note="vLLM 0.32 has no DeepSeek sparse attention on CPUs, and the torch engine "
                         "(transformers) runs another lightning indexer than Kiln's"),
    sparse_attention=("index_topk", "index_n_heads", "index_head_dim"),
    defaults_only=DEEPSEEK_V3.defaults_only,
)

FAMILIES: tuple[Family, ...] = (QWEN2, LLAMA, QWEN2_MOE, QWEN3, QWEN3_MOE, GLM4_MOE, DEEPSEEK_V3, DEEPSEEK_V32)
BY_NAME = {f.name: f for f in FAMILIES}
BY_ARCHITECTURE = {a: f for f in FAMILIES for a in f.architectures}
SUPPORTED_ARCHS = {a: f.name for a, f in BY_ARCHITECTURE.items()}
"""Hugging Face architecture -> family name."""


_YARN_UNBUILT = {("truncate", False)}


def family_of(config: dict[str, Any]) -> Family | None:
    """The family of a config.json (its first known `architectures` entry), or None."""
    return next((BY_ARCHITECTURE[a] for a in config.get("architectures") or [] if a in BY_ARCHITECTURE), None)


def dsa_entry(config: dict[str, Any]) -> dict[str, Any] | None:
    """The DeepSeek-sparse-attention settings of a config.json as a `kiln_dsa` entry
    (`index_topk`, `index_heads`, `index_dim`): its `kiln_dsa`, or its family's built-in sparse
    attention fields (values unchecked, absent ones None); None for dense attention."""
    if config.get("kiln_dsa") is not None:
        return config["kiln_dsa"]
    family = family_of(config)
    if family is None or family.sparse_attention is None:
        return None
    return dict(zip(("index_topk", "index_heads", "index_dim"), (config.get(f) for f in family.sparse_attention)))


def is_dsa_config(config: dict[str, Any]) -> bool:
    """Whether the model selects each query's keys with a lightning indexer (DSA)."""
    return dsa_entry(config) is not None


def config_problems(config: dict[str, Any], families: tuple[Family, ...] = FAMILIES) -> list[str]:
    """One line per reason the model code cannot build this config.json (each naming a field);
    empty when it can."""
    archs = config.get("architectures") or []
    family = next((f for a in archs for f in families if a in f.architectures), None)
    if family is None:
        names = sorted(a for f in families for a in f.architectures)
        return [f"architecture {', '.join(archs) or '(none)'} is not supported; the trainer builds "
                f"{', '.join(names)}"]
    problems = [f"config.json {name}={config[name]!r}: {family.title} is built with {name}={value!r} only"
                for name, value in family.defaults_only if config.get(name, value) != value]
    if (quant := config.get("quantization_config")) is not None:
        # DeepSeek-V3's and Kimi K2's hub weights are FP8 blocks with scales: read as plain
        # tensors they would be garbage, so refuse rather than load them.
        method = quant.get("quant_method") if isinstance(quant, dict) else quant
        problems.append(f"config.json quantization_config (quant_method {method!r}): quantised checkpoints "
                        "are not supported; dequantise to bfloat16 first")
    # transformers 5 writes RoPE scaling into rope_parameters, older checkpoints into rope_scaling.
    for field in ("rope_scaling", "rope_parameters"):
        scaling = config.get(field)
        if scaling and scaling.get("rope_type", scaling.get("type")) not in (None, "default",
                                                                            *family.attention.rope_scaling):
            problems.append(f"config.json {field}={scaling}: RoPE scaling is not supported")
        elif scaling and (odd := [k for k, v in scaling.items()
                                  if (k, v) in _YARN_UNBUILT or k == "attention_factor"]):
            # Megatron's YaRN derives the attention factor and rounds the correction range.
            problems.append(f"config.json {field} {', '.join(odd)}: YaRN is built with a derived "
                            "attention factor and truncate true only")
    if (fraction := family.attention.rotary_percent(config)) != 1.0:
        head = config.get("head_dim") or config.get("hidden_size", 0) // config.get("num_attention_heads", 1)
        rotary = fraction * head
        if not 0 < fraction <= 1 or rotary != int(rotary) or int(rotary) % 2:
            problems.append(f"config.json {family.attention.rotary_fraction}={fraction}: the rotated part of "
                            "each head must be a positive even number of dimensions")
    if config.get("kiln_dsa") is not None and not family.dsa:
        problems.append(f"config.json kiln_dsa: DeepSeek sparse attention is not built for {family.title}")
    if family.sparse_attention is not None:
        problems += [f"config.json {f}={config.get(f)!r}: {family.title} needs a positive integer"
                     for f in family.sparse_attention
                     if not isinstance(config.get(f), int) or isinstance(config.get(f), bool) or config[f] < 1]
    if (m := family.moe) is not None:
        problems += _moe_problems(config, family.title, m)
    return problems


def _moe_problems(config: dict[str, Any], title: str, m: MoE) -> list[str]:
    num, k = m.experts(config), config.get(m.topk)
    if num is None or k is None or config.get(m.ffn) is None:
        return [f"config.json lacks {' or '.join(m.num_experts)}, {m.topk} or {m.ffn} ({title})"]
    problems = [] if 1 <= k <= num else [f"config.json {m.topk}={k} must be in [1, {'/'.join(m.num_experts)}={num}]"]
    fields = [f for f in (m.sparse_step, m.dense_list) if f]
    if fields and (dense := [i for i in m.dense_layers(config)
                             if i >= ((config.get(m.first_dense) or 0) if m.first_dense else 0)]):
        problems.append(
            f"config.json {' '.join(f'{f}={config.get(f)!r}' for f in fields)}: layers {dense} are dense; "
            f"only {title} models whose every layer is sparse are supported")
    if m.score == "sigmoid" and k > 1 and not config.get("norm_topk_prob", m.norm_topk_prob):
        problems.append(f"config.json norm_topk_prob=False: {title} is built with renormalised sigmoid "
                        "weights only (norm_topk_prob true)")
    if (groups := m.groups(config)) is not None:
        n, kept = groups
        gf, tf = m.expert_groups
        if num % n or not 1 <= kept <= n:
            problems.append(f"config.json {gf}={n}, {tf}={kept}: {gf} must divide {num} experts and "
                            f"{tf} be in [1, {gf}]")
        elif k != 2 * kept:
            # Megatron ranks a group by its best num_experts_per_tok / topk_group scores,
            # transformers (and the released checkpoints) by its best 2.
            problems.append(f"config.json {m.topk}={k}, {tf}={kept}: group-limited routing is built only "
                            f"where {m.topk} = 2 x {tf} (each group ranked by its 2 best experts)")
    return problems


def _built_as(f: Family) -> str:
    a, m = f.attention, f.moe
    attention = ("MLA + DSA" if f.sparse_attention else "MLA") if a.kind == "mla" else "GQA" + "".join(
        f" + {what}" for what, on in (("q/k norm", (a.qk_layernorm or a.qk_layernorm_field) and a.kind == "gqa"),
                                       ("partial RoPE", a.rotary_fraction)) if on)
    if m is None:
        return attention
    routing = "softmax top-k" if m.score == "softmax" else "sigmoid top-k" + "".join(
        f" + {what}" for what, on in (("bias", m.expert_bias), ("groups", m.expert_groups),
                                       ("dense first layers", m.first_dense)) if on)
    return f"{attention}; {routing}"


def supported_models_table() -> str:
    """The model guide's supported-models table (markdown), generated from the entries."""
    lines = ["| architecture | family | built as | rollout engines (CPU / GPU) | tensor parallel | routing replay | DSA |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for f in FAMILIES:
        engines = (", ".join(f.rollout.cpu) if f.rollout.cpu == f.rollout.gpu
                   else f"{', '.join(f.rollout.cpu)} / {', '.join(f.rollout.gpu)}")
        tp = "any that divides the heads" if f.max_tensor_parallel is None else f"{f.max_tensor_parallel} only"
        for arch in f.architectures:
            lines.append(f"| `{arch}` | {f.title} | {_built_as(f)} | {engines} | {tp} | "
                         f"{'yes' if f.moe else 'n/a (dense)'} | {'built in' if f.sparse_attention else 'yes' if f.dsa else 'no'} |")
    return "\n".join(lines)
