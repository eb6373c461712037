"""Chat templates whose tool calls Kiln's chat formats cannot read (GLM-4.5's XML arguments,
DeepSeek's, gpt-oss's harmony) are refused at `spec.rollout.toolCallFormat` whenever the tools
would be rendered with them, never served with a hermes parser that fails every call; Kiln's own
(hermes, Qwen3-style `<think>`) templates pass."""
from __future__ import annotations

import json

import pytest

from kiln.api.capabilities import Target, model_refusals
from kiln.models.tiny import CHAT_TEMPLATE_WITH_TOOLS

from helpers.capabilities import GLM45_TOOLS_TEMPLATE, checkpoint_config

DEEPSEEK_TOOLS = "{% if tools %}<\uff5ctool\u2581calls\u2581begin\uff5c>{% endif %}"


def _refused(model_dir, fmt: str) -> list[str]:
    return [str(r) for r in model_refusals(model_dir, Target(engine="megatron", tool_call_format=fmt))
            if r.capability.name == "chat-tool-format"]


@pytest.mark.parametrize(("template", "what"), [(GLM45_TOOLS_TEMPLATE, "GLM-4.5's XML tool calls"),
                                                 (DEEPSEEK_TOOLS, "DeepSeek's tool calls")])
def test_a_foreign_tool_format_is_refused_unless_tags(tmp_path, template, what) -> None:
    d = checkpoint_config(tmp_path)
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    for fmt in ("hermes", "auto", "llama3"):
        (refusal,) = _refused(d, fmt)
        assert refusal.startswith(f"spec.rollout.toolCallFormat: toolCallFormat {fmt}: the tokenizer's chat "
                                  f"template writes {what}")
        assert "use toolCallFormat tags" in refusal
    assert _refused(d, "tags") == []


def test_kiln_hermes_template_and_a_template_without_tools_pass(tmp_path) -> None:
    d = checkpoint_config(tmp_path)
    # transformers 5 writes the template beside the tokenizer as chat_template.jinja.
    (d / "chat_template.jinja").write_text(CHAT_TEMPLATE_WITH_TOOLS)
    assert _refused(d, "auto") == _refused(d, "hermes") == []
    plain = checkpoint_config(tmp_path / "plain")
    # A template that renders no tools makes `auto` mean tags, whatever else it writes.
    (plain / "tokenizer_config.json").write_text(json.dumps({"chat_template": [
        {"name": "default", "template": "{{ messages }}<arg_key>"}]}))
    assert _refused(plain, "auto") == []
    assert len(_refused(plain, "hermes")) == 1
