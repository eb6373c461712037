"""Tiny tokenizers and randomly initialised models, made locally, for tests, benchmarks and the
quickstart.

Nothing is downloaded: the tokenizer is a byte-level BPE trained with the `tokenizers` library
on whatever texts the caller gives, and the model is a checkpoint of one of `ARCHS` (Qwen2,
Llama, Qwen3 and the MoE variants, GLM-4.5 MoE, DeepSeek-V3) with random weights written in the Hugging Face layout
(config.json, generation_config.json, model.safetensors and the tokenizer files). Both transformers (`AutoTokenizer`,
`AutoModelForCausalLM`) and vLLM's CPU engine load the result.

Token ids are laid out so that every caller can rely on them: the chat control tokens come first
(`<|endoftext|>` = 0, `<|im_start|>` = 1, `<|im_end|>` = 2, `<|pad|>` = 3), then the 256 byte
tokens and the learned merges, then any extra tokens (for example `<tool_call>`), which are
added as ordinary (non-special) tokens so that decoding with `skip_special_tokens=True` keeps
them in the text where tool-call parsers look for them, then reserved special tokens that round
the vocabulary up to a multiple of 64 (so it splits evenly over tensor-parallel ranks).

What this does not cover: quality. The tokenizer is only as good as the texts it is given, and
the model is untrained; use `kiln.services.trainer` to train it.
"""
from __future__ import annotations

import json
import shutil
from collections.abc import Iterable
from pathlib import Path

BOS_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
PAD_TOKEN = "<|pad|>"
CHAT_TOKENS: tuple[str, ...] = (BOS_TOKEN, IM_START, IM_END, PAD_TOKEN)
"""Always present, always special, always ids 0..3, in this order."""
EOS_TOKEN = IM_END
"""A reply ends with `<|im_end|>`; generation stops there."""

DEFAULT_SPECIAL_TOKENS: list[str] = [
    *CHAT_TOKENS,
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
]

# ChatML. The newline characters are real ones: the template is Jinja, not a Python literal.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# ChatML with tools, as Qwen2.5's template does it but compact (a tiny model's context is short):
# the tools are one line each in a system message, calls are `<tool_call>{json}</tool_call>` in
# the assistant's reply (the hermes format; a tiny model learns it from its demonstrations, so no
# instructions are written), and a tool's output comes back as a `tool` message (Qwen wraps it in
# a user message's `<tool_response>`: five more tokens a turn, between what a tool printed and
# the next call that copies it). Earlier assistant turns are written as they are.
CHAT_TEMPLATE_WITH_TOOLS = (
    "{%- set first = messages[0] if messages else {} -%}"
    "{%- if tools -%}"
    "{{ '<|im_start|>system\n' }}"
    "{%- if first['role'] == 'system' %}{{ first['content'] + '\n' }}{% endif -%}"
    "{{ 'Tools:\n' }}"
    "{%- for tool in tools -%}"
    "{{ tool['function']['name'] + '(' + (tool['function']['parameters']['properties'] | list"
    " | join(', ')) + '): ' + tool['function']['description'] + '\n' }}"
    "{%- endfor -%}"
    "{{ '<|im_end|>\n' }}"
    "{%- elif first['role'] == 'system' -%}"
    "{{ '<|im_start|>system\n' + first['content'] + '<|im_end|>\n' }}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'tool' -%}"
    "{{ '<|im_start|>tool\n' + message['content'] + '<|im_end|>\n' }}"
    "{%- elif message['role'] != 'system' -%}"
    "{{ '<|im_start|>' + message['role'] + '\n' + (message['content'] or '') }}"
    # Calls given as structured tool_calls (a history an outside agent sends back) are written
    # as hermes calls; Kiln's own turns carry their calls in the content, as sampled.
    "{%- for call in message.get('tool_calls') or [] -%}"
    "{{ '<tool_call>\n' + ({'name': call['function']['name'], 'arguments': call['function']['arguments']}"
    " | tojson) + '\n</tool_call>' }}"
    "{%- endfor -%}"
    "{{ '<|im_end|>\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif -%}"
)

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)

ARCHS = ("qwen2", "llama", "qwen2_moe", "qwen3", "qwen3_moe", "glm4_moe", "deepseek_v3", "deepseek_v32")
VOCAB_MULTIPLE = 64
DTYPES = ("float32", "bfloat16", "float16")


def train_tokenizer(
    texts: Iterable[str],
    out_dir: Path,
    *,
    vocab_size: int = 512,
    special_tokens: list[str] = DEFAULT_SPECIAL_TOKENS,
    split_digits: bool = False,
    pad_to_multiple: int = VOCAB_MULTIPLE,
    chat_template: str = CHAT_TEMPLATE,
    pre_tokenization: str = "gpt2",
) -> Path:
    """Train a byte-level BPE tokenizer on `texts` and save it as a Hugging Face tokenizer
    directory at `out_dir` (created if needed). Returns `out_dir`.

    `vocab_size` bounds the number of special + byte + merged tokens (a small corpus may give
    fewer merges); extra tokens from `special_tokens` beyond the chat tokens come after it, then
    `<|reserved_i|>` tokens up to the next multiple of `pad_to_multiple` (the vocabulary must
    split evenly over tensor-parallel ranks).

    Padding has a cost for a tiny model with tied embeddings: tokens that never occur still take
    part in every softmax, and 44 of them slowed SFT of the quickstart's 0.43 M-parameter model
    several-fold (held-out success 0.32 instead of 0.70 after 1000 steps, same data and seed).
    Pass `pad_to_multiple=1` when no tensor parallelism is needed.
    `pre_tokenization`: how text is cut into words before merges are learned. "gpt2" is GPT-2's
    byte-level rule; "qwen2" is the rule transformers applies when it loads a qwen2-architecture
    checkpoint's tokenizer (its Qwen2Tokenizer rebuilds the pipeline from the vocabulary and
    merges), so every merge learned is one the loaded tokenizer uses.
    Deterministic for the same texts and arguments.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < len(CHAT_TOKENS) + 256:
        raise ValueError(
            f"vocab_size={vocab_size} must be at least {len(CHAT_TOKENS) + 256} "
            "(chat tokens plus the 256 byte tokens); retrying with the same value will not help"
        )
    extra = [t for t in dict.fromkeys(special_tokens) if t not in CHAT_TOKENS]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    tok = Tokenizer(models.BPE())
    if pre_tokenization == "qwen2":
        from tokenizers import Regex
        from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

        # Qwen's rule already cuts every digit apart.
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    elif pre_tokenization == "gpt2":
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
        # With `split_digits`, every digit is its own pre-token, so no merge joins two digits: a
        # tiny model then copies and computes numbers digit by digit.
        tok.pre_tokenizer = (pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
                             if split_digits else byte_level)
    else:
        raise ValueError(f"pre_tokenization={pre_tokenization!r} is not 'gpt2' or 'qwen2'")
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(CHAT_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in extra])
    # Round the vocabulary up so that it splits evenly over tensor-parallel ranks.
    if pad_to_multiple < 1:
        raise ValueError(f"pad_to_multiple={pad_to_multiple} must be at least 1")
    pad = -tok.get_vocab_size(with_added_tokens=True) % pad_to_multiple
    tok.add_special_tokens([AddedToken(f"<|reserved_{i}|>", special=True, normalized=False) for i in range(pad)])

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=None,
        additional_special_tokens=[IM_START],
        clean_up_tokenization_spaces=False,
        model_max_length=1 << 20,
    )
    fast.chat_template = chat_template
    fast.save_pretrained(str(out_dir))
    return out_dir


def make_tiny_model(
    out_dir: Path,
    tokenizer_dir: Path,
    *,
    arch: str = "qwen2",
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 256,
    max_position_embeddings: int = 1024,
    seed: int = 0,
    dtype: str = "float32",
    tie_word_embeddings: bool = False,
    perturb_norms: bool = True,
    num_experts: int = 8,
    num_experts_per_tok: int = 2,
    moe_intermediate_size: int = 64,
    shared_expert_intermediate_size: int = 128,
    head_dim: int | None = None,
    norm_topk_prob: bool | None = None,
    n_group: int = 1,
    topk_group: int = 1,
    first_k_dense_replace: int = 1,
    routed_scaling_factor: float = 2.5,
    q_lora_rank: int | None = 32,
    kv_lora_rank: int = 32,
    qk_nope_head_dim: int = 16,
    qk_rope_head_dim: int = 16,
    v_head_dim: int = 16,
    rope_scaling: dict | None = None,
    index_topk: int = 64,
    index_n_heads: int = 2,
    index_head_dim: int = 16,
) -> Path:
    """Write a randomly initialised `arch` checkpoint (one of `ARCHS`: Qwen2, Llama, Qwen2-MoE,
    Qwen3, Qwen3-MoE, GLM-4.5 MoE, DeepSeek-V3) to `out_dir`, with the tokenizer from `tokenizer_dir` copied in. Returns
    `out_dir`.

    The MoE archs use the `num_experts*` and `moe_intermediate_size` arguments, and `qwen2_moe`
    also `shared_expert_intermediate_size` (0: no shared expert); every layer is sparse.
    `norm_topk_prob` defaults to each family's usual value (Qwen2-MoE False, Qwen3-MoE True).
    `head_dim` (default hidden_size / num_heads) is written for Qwen3 and Qwen3-MoE, whose heads
    need not divide the hidden size.
    `glm4_moe` (GLM-4.5 MoE) has q/k/v biases, q/k norms, half-rotary RoPE, sigmoid routing with
    an expert score bias (random, like the norms), one shared expert, `first_k_dense_replace`
    dense first layers, `routed_scaling_factor` and `n_group`/`topk_group` expert groups.
    `deepseek_v3` (DeepSeek-V3, the Kimi K2 shape) routes as `glm4_moe` does, with multi-latent
    attention of the `*_lora_rank` and `*_head_dim` arguments (`q_lora_rank` None: no query
    compression), interleaved RoPE (`rope_scaling`: e.g. YaRN's settings) and
    `topk_method: noaux_tc` written as the hub's have it.
    `deepseek_v32` (DeepSeek-V3.2's shape) is that `deepseek_v3` model with a random lightning
    indexer per layer choosing `index_topk` keys per query (`dsa.to_tiny_deepseek_v32`).

    The vocabulary is exactly the tokenizer's, so every id the model can sample decodes.
    The same arguments give bit-identical weights. `perturb_norms` (for tests) draws norm
    weights around 1 and biases around 0 instead of the usual exact 1 and 0; a model meant to
    be trained should pass False.
    """
    if arch == "deepseek_v32":  # before any other local: these are the arguments
        v3 = {k: v for k, v in locals().items() if k not in ("arch", "index_topk", "index_n_heads", "index_head_dim")}
        from kiln.models.dsa import DSAConfig, to_tiny_deepseek_v32
        return to_tiny_deepseek_v32(make_tiny_model(**v3, arch="deepseek_v3"),
                                    DSAConfig(index_topk, index_n_heads, index_head_dim), seed)
    import torch
    from transformers import (AutoTokenizer, DeepseekV3Config, Glm4MoeConfig, GenerationConfig, LlamaConfig,
                              Qwen2Config, Qwen2MoeConfig, Qwen3Config, Qwen3MoeConfig)
    from transformers import AutoModelForCausalLM

    if arch not in ARCHS:
        raise ValueError(f"arch={arch!r} is not one of {ARCHS}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not one of {DTYPES}")
    if hidden_size % num_heads and (head_dim is None or arch not in ("qwen3", "qwen3_moe", "glm4_moe")):
        raise ValueError(f"hidden_size={hidden_size} must be divisible by num_heads={num_heads}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} must be divisible by num_kv_heads={num_kv_heads}")
    tokenizer_dir = Path(tokenizer_dir)
    out_dir = Path(out_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))

    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        hidden_act="silu",
        initializer_range=0.02,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    if arch == "qwen2":
        config = Qwen2Config(use_sliding_window=False, **common)
    elif arch == "qwen2_moe":
        config = Qwen2MoeConfig(
            use_sliding_window=False, num_experts=num_experts, num_experts_per_tok=num_experts_per_tok,
            moe_intermediate_size=moe_intermediate_size,
            shared_expert_intermediate_size=shared_expert_intermediate_size,
            decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=bool(norm_topk_prob),
            output_router_logits=False, router_aux_loss_coef=0.0, **common)
    elif arch == "qwen3":
        config = Qwen3Config(use_sliding_window=False, head_dim=head_dim or hidden_size // num_heads,
                             attention_bias=False, **common)
    elif arch == "qwen3_moe":
        config = Qwen3MoeConfig(
            use_sliding_window=False, head_dim=head_dim or hidden_size // num_heads, attention_bias=False,
            num_experts=num_experts, num_experts_per_tok=num_experts_per_tok,
            moe_intermediate_size=moe_intermediate_size, decoder_sparse_step=1, mlp_only_layers=[],
            norm_topk_prob=True if norm_topk_prob is None else norm_topk_prob,
            output_router_logits=False, router_aux_loss_coef=0.0, **common)
    elif arch == "glm4_moe":
        config = Glm4MoeConfig(
            head_dim=head_dim or hidden_size // num_heads, attention_bias=True, use_qk_norm=True,
            partial_rotary_factor=0.5, n_routed_experts=num_experts, num_experts_per_tok=num_experts_per_tok,
            moe_intermediate_size=moe_intermediate_size, n_shared_experts=1, n_group=n_group,
            topk_group=topk_group, first_k_dense_replace=first_k_dense_replace,
            routed_scaling_factor=routed_scaling_factor, norm_topk_prob=True, num_nextn_predict_layers=0,
            output_router_logits=False, **common)
    elif arch == "deepseek_v3":
        config = DeepseekV3Config(
            q_lora_rank=q_lora_rank, kv_lora_rank=kv_lora_rank, qk_nope_head_dim=qk_nope_head_dim,
            qk_rope_head_dim=qk_rope_head_dim, v_head_dim=v_head_dim, rope_interleave=True,
            attention_bias=False, n_routed_experts=num_experts, num_experts_per_tok=num_experts_per_tok,
            moe_intermediate_size=moe_intermediate_size, n_shared_experts=1, n_group=n_group,
            topk_group=topk_group, first_k_dense_replace=first_k_dense_replace,
            routed_scaling_factor=routed_scaling_factor, norm_topk_prob=True, num_nextn_predict_layers=0,
            output_router_logits=False, **{**common, "num_key_value_heads": num_heads},
            **({"rope_parameters": {"rope_theta": 10000.0, **rope_scaling}} if rope_scaling else {}))
        # vLLM reads the selection rule from here (transformers always routes this way).
        config.topk_method = "noaux_tc"
    else:
        config = LlamaConfig(attention_bias=False, mlp_bias=False, **common)

    torch_dtype = getattr(torch, dtype)
    # Initialise under a private generator state so the caller's RNG stream is left alone.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        # HF starts norms at 1 and biases at 0; random values make a weight mapping that
        # swaps or drops them visible in the logits.
        if perturb_norms:
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if name.endswith("norm.weight"):
                        p.copy_(1.0 + 0.1 * torch.randn_like(p))
                    elif name.endswith(".bias"):
                        p.copy_(0.02 * torch.randn_like(p))
                # A selection bias of the size of the score spread, so a mapping that drops it
                # routes differently.
                for name, b in model.named_buffers():
                    if name.endswith("e_score_correction_bias"):
                        b.copy_(0.05 * torch.randn_like(b))
    model = model.to(torch_dtype)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    copy_tokenizer(tokenizer_dir, out_dir)
    return out_dir


DEFAULT_CORPUS: tuple[str, ...] = tuple(
    f"<|im_start|>user\nWhat is {a} + {b}? Use the calculator.<|im_end|>\n"
    f"<|im_start|>assistant\n<think>I add {a} and {b}.</think><tool_call>add({a}, {b})</tool_call><|im_end|>\n"
    f"<|im_start|>tool\n<tool_response>{a + b}</tool_response><|im_end|>\n"
    f"<|im_start|>assistant\nThe answer is {a + b}.<|im_end|>"
    for a in range(0, 100, 7)
    for b in range(3, 60, 11)
)
"""A small chat-and-tool-call corpus, enough for a tokenizer that splits such text sensibly."""


def make_tiny_checkpoint(out_dir: Path, *, texts: Iterable[str] | None = None, vocab_size: int = 512, **model_kwargs) -> Path:
    """Tokenizer + model in one directory: `train_tokenizer` on `texts` (default
    `DEFAULT_CORPUS`) and `make_tiny_model` with `model_kwargs`. Returns `out_dir`."""
    out_dir = Path(out_dir)
    tok_dir = out_dir.with_name(out_dir.name + ".tokenizer")
    train_tokenizer(DEFAULT_CORPUS if texts is None else texts, tok_dir, vocab_size=vocab_size)
    make_tiny_model(out_dir, tok_dir, **model_kwargs)
    shutil.rmtree(tok_dir)
    return out_dir


def copy_tokenizer(tokenizer_dir: Path, out_dir: Path) -> None:
    """Copy the tokenizer files of `tokenizer_dir` (those present) into `out_dir`."""
    tokenizer_dir, out_dir = Path(tokenizer_dir), Path(out_dir)
    if not (tokenizer_dir / "tokenizer.json").exists():
        raise ValueError(f"tokenizer_dir={tokenizer_dir} holds no tokenizer.json")
    for name in TOKENIZER_FILES:
        src = tokenizer_dir / name
        if src.exists():
            shutil.copyfile(src, out_dir / name)


def read_config(model_dir: Path) -> dict:
    """The parsed config.json of a checkpoint directory."""
    return json.loads((Path(model_dir) / "config.json").read_text())
