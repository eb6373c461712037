"""A tiny checkpoint that calls tools: a chat tokenizer with the tool-calling template and a
model fine-tuned (plain PyTorch, a few seconds) to play one short script, so that an agent
scaffold's episode against it has tool calls in it.

    user       List the files, then read the first one.
    assistant  <tool_call>{"name": "bash", "arguments": {"command": "ls"}}</tool_call>
    tool       a.txt
    assistant  <tool_call>{"name": "bash", "arguments": {"command": "cat a.txt"}}</tool_call>
    tool       hello
    assistant  Done.
"""
from __future__ import annotations

from pathlib import Path

import torch

from kiln.env import ToolCall, string_tool
from kiln.models.tiny import CHAT_TEMPLATE_WITH_TOOLS, DEFAULT_SPECIAL_TOKENS, make_tiny_model, train_tokenizer
from kiln.services.rollout.formats import toolcalls

BASH = string_tool("bash", "Run a command.", command="the command")
TOOLS = [BASH.to_openai()]
PROMPT = "List the files, then read the first one."
SCRIPT = [("ls", "a.txt"), ("cat a.txt", "hello")]
FINAL = "Done."


def script_messages() -> list[dict]:
    messages = [{"role": "user", "content": PROMPT}]
    for command, output in SCRIPT:
        call = toolcalls.render([ToolCall("bash", {"command": command})], "", "hermes")
        messages += [{"role": "assistant", "content": call}, {"role": "tool", "content": output}]
    return messages + [{"role": "assistant", "content": FINAL}]


def make_toolcall_model(out_dir: Path, steps: int = 150) -> Path:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out_dir = Path(out_dir)
    tok_dir = out_dir.with_name(out_dir.name + ".tokenizer")
    corpus = [toolcalls.render([ToolCall("bash", {"command": c})], "", "hermes") for c, _ in SCRIPT]
    corpus += [PROMPT, FINAL, "a.txt", "hello", "Run a command."] * 20
    train_tokenizer(corpus * 5, tok_dir, vocab_size=320, special_tokens=DEFAULT_SPECIAL_TOKENS,
                    chat_template=CHAT_TEMPLATE_WITH_TOOLS, split_digits=True,
                    pre_tokenization="qwen2", pad_to_multiple=1)
    # head_dim 32: a head size vLLM's CPU attention runs.
    make_tiny_model(out_dir, tok_dir, hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=2,
                    intermediate_size=128, max_position_embeddings=512, tie_word_embeddings=True,
                    perturb_norms=False)
    tok = AutoTokenizer.from_pretrained(str(out_dir))
    text = tok.apply_chat_template(script_messages(), tools=TOOLS, tokenize=False)
    ids = torch.tensor([tok.encode(text, add_special_tokens=False)])
    model = AutoModelForCausalLM.from_pretrained(str(out_dir), dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(0)
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.save_pretrained(str(out_dir))
    return out_dir


_SHARED: dict[str, Path] = {}


def shared_toolcall_model(tmp_path_factory) -> Path:
    """One `make_toolcall_model` per test session (training it takes seconds), for the modules
    that only read it."""
    if "model" not in _SHARED:
        _SHARED["model"] = make_toolcall_model(tmp_path_factory.mktemp("toolcall") / "m")
    return _SHARED["model"]
