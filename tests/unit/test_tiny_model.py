"""The tiny tokenizer and model maker: what transformers sees, determinism, id layout."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from kiln.models.tiny import (
    CHAT_TOKENS,
    DEFAULT_CORPUS,
    VOCAB_MULTIPLE,
    make_tiny_checkpoint,
    make_tiny_model,
    read_config,
    train_tokenizer,
)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_tokenizer(DEFAULT_CORPUS, tmp_path_factory.mktemp("tok"), vocab_size=400)


def test_tokenizer_layout_and_round_trip(tok_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    assert tok.convert_tokens_to_ids(list(CHAT_TOKENS)) == [0, 1, 2, 3]
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<|endoftext|>", "<|im_end|>", "<|pad|>")
    assert len(tok) % VOCAB_MULTIPLE == 0
    text = "What is 12 + 345? <tool_call>add(12, 345)</tool_call> caf\u00e9 \u4e16\u754c"
    ids = tok(text)["input_ids"]
    assert tok.decode(ids) == text
    # Tool-call markers are single, non-special tokens: they survive skip_special_tokens.
    tc = tok.convert_tokens_to_ids("<tool_call>")
    assert tc in ids and tc not in tok.all_special_ids
    assert tok.decode(ids, skip_special_tokens=True) == text
    # Merges were learned from the corpus (fewer tokens than bytes).
    assert len(tok("The answer is")["input_ids"]) < len("The answer is")


def test_chat_template(tok_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    msgs = [{"role": "user", "content": "hi"}]
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_tokenizer_is_deterministic(tok_dir: Path, tmp_path: Path) -> None:
    again = train_tokenizer(DEFAULT_CORPUS, tmp_path / "again", vocab_size=400)
    assert (again / "tokenizer.json").read_bytes() == (tok_dir / "tokenizer.json").read_bytes()


def test_tokenizer_rejects_too_small_vocab(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="vocab_size"):
        train_tokenizer(["abc"], tmp_path, vocab_size=100)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_model_loads_in_transformers_and_is_deterministic(tok_dir: Path, tmp_path: Path, arch: str) -> None:
    a = make_tiny_model(tmp_path / "a", tok_dir, arch=arch, hidden_size=64, seed=3)
    b = make_tiny_model(tmp_path / "b", tok_dir, arch=arch, hidden_size=64, seed=3)
    c = make_tiny_model(tmp_path / "c", tok_dir, arch=arch, hidden_size=64, seed=4)
    sa, sb, sc = (load_file(str(d / "model.safetensors")) for d in (a, b, c))
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert any(not torch.equal(sa[k], sc[k]) for k in sa)
    model = AutoModelForCausalLM.from_pretrained(str(a))
    tok = AutoTokenizer.from_pretrained(str(a))
    cfg = read_config(a)
    assert cfg["model_type"] == arch and cfg["vocab_size"] == len(tok) and cfg["hidden_size"] == 64
    assert cfg["eos_token_id"] == tok.eos_token_id
    ids = torch.tensor([tok("The answer is 7.")["input_ids"]])
    logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], len(tok)) and torch.isfinite(logits).all()
    # Norms and biases are randomised, not HF's 1 and 0.
    norms = [v for k, v in sa.items() if k.endswith("norm.weight")]
    assert all(not torch.all(v == 1.0) for v in norms)
    if arch == "qwen2":
        assert not torch.all(sa["model.layers.0.self_attn.q_proj.bias"] == 0)


def test_model_bf16_and_tied(tok_dir: Path, tmp_path: Path) -> None:
    d = make_tiny_model(tmp_path / "m", tok_dir, hidden_size=64, dtype="bfloat16", tie_word_embeddings=True)
    sd = load_file(str(d / "model.safetensors"))
    assert {t.dtype for t in sd.values()} == {torch.bfloat16}
    assert "lm_head.weight" not in sd
    assert AutoModelForCausalLM.from_pretrained(str(d)).config.tie_word_embeddings


def test_make_tiny_model_rejects_bad_arguments(tok_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="arch"):
        make_tiny_model(tmp_path, tok_dir, arch="gpt2")
    with pytest.raises(ValueError, match="num_kv_heads"):
        make_tiny_model(tmp_path, tok_dir, num_heads=4, num_kv_heads=3)


def test_make_tiny_checkpoint_one_directory(tmp_path: Path) -> None:
    d = make_tiny_checkpoint(tmp_path / "ckpt", hidden_size=64, num_layers=1)
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in d.iterdir()}
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]
