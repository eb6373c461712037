"""Chat templates whose tool calls the chosen format cannot read are refused at
`spec.rollout.toolCallFormat` whenever the tools would be rendered with them, never served with a
parser that fails every call: GLM-4.5's XML arguments unless glm45 (or auto, which picks it);
DeepSeek's and gpt-oss's harmony always (no format reads them). Kiln's own (hermes, Qwen3-style
`<think>`) templates pass."""
from __future__ import annotations

import json


from kiln.api.capabilities import Target, model_refusals
from kiln.models.tiny import CHAT_TEMPLATE_WITH_TOOLS

from helpers.capabilities import GLM45_TOOLS_TEMPLATE, checkpoint_config

DEEPSEEK_TOOLS = "{% if tools %}<\uff5ctool\u2581calls\u2581begin\uff5c>{% endif %}"


def _refused(model_dir, fmt: str) -> list[str]:
    return [str(r) for r in model_refusals(model_dir, Target(engine="megatron", tool_call_format=fmt))
            if r.capability.name == "chat-tool-format"]


def test_a_foreign_tool_format_is_refused_unless_tags(tmp_path) -> None:
    d = checkpoint_config(tmp_path)
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": DEEPSEEK_TOOLS}))
    for fmt in ("hermes", "auto", "llama3", "glm45"):
        (refusal,) = _refused(d, fmt)
        assert refusal.startswith(f"spec.rollout.toolCallFormat: toolCallFormat {fmt}: the tokenizer's chat "
                                  "template writes DeepSeek's tool calls")
        assert "use toolCallFormat tags" in refusal
    assert _refused(d, "tags") == []


def test_glm_tool_calls_need_the_glm45_format(tmp_path) -> None:
    d = checkpoint_config(tmp_path)
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": GLM45_TOOLS_TEMPLATE}))
    for fmt in ("hermes", "llama3"):
        (refusal,) = _refused(d, fmt)
        assert refusal.startswith(f"spec.rollout.toolCallFormat: toolCallFormat {fmt}: the tokenizer's chat "
                                  "template writes GLM-4.5's XML tool calls")
        assert "use toolCallFormat glm45 (or auto)" in refusal
    assert _refused(d, "glm45") == _refused(d, "auto") == _refused(d, "tags") == []


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
