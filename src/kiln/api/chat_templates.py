"""What a checkpoint's chat template says about its tool calls, read without a tokenizer library
(torch-free, for the capability table): its text, and whether its tool-call format is one Kiln's
chat formats parse (`kiln.services.rollout.formats`: hermes, llama3, glm45). Used by
`kiln.api.capabilities` (`chat-tool-format`)."""
from __future__ import annotations

import json
from pathlib import Path


def chat_template(model_dir: Path) -> str:
    """The chat template text: chat_template.jinja (transformers 5), or tokenizer_config.json's
    `chat_template` (a string, or named templates whose texts are joined)."""
    jinja = model_dir / "chat_template.jinja"
    if jinja.exists():
        return jinja.read_text()
    path = model_dir / "tokenizer_config.json"
    if not path.exists():
        return ""
    template = json.loads(path.read_text()).get("chat_template") or ""
    if isinstance(template, list):
        return "\n".join(t.get("template", "") for t in template if isinstance(t, dict))
    return template if isinstance(template, str) else ""


#: Tool-call formats a chat template may write: (a marker only that format's templates contain,
#: what it is, the `toolCallFormat` that reads it or None). Rendering the tools with such a
#: template and reading the replies in another format would fail every call, silently.
FOREIGN_TOOL_FORMATS = (
    ("<arg_key>", "GLM-4.5's XML tool calls (<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>)",
     "glm45"),
    ("tool\u2581calls\u2581begin", "DeepSeek's tool calls (<\uff5ctool\u2581calls\u2581begin\uff5c>)",
     None),
    ("<|channel|>", "gpt-oss's harmony channels and tool calls", None),
)


def foreign_tool_format(template: str, fmt: str) -> str | None:
    """Why rollout cannot use `template` (a chat template's text) with `toolCallFormat`
    `fmt`; None when it can."""
    # `auto` takes the chat template only when it renders tools (else `tags`, which is fine).
    if fmt == "tags" or (fmt == "auto" and "tools" not in template):
        return None
    for marker, what, reader in FOREIGN_TOOL_FORMATS:
        if marker not in template or fmt in (reader, "auto" if reader else None):
            continue  # `auto` picks the format that reads it
        if reader is not None:
            return (f"toolCallFormat {fmt}: the tokenizer's chat template writes {what}; use "
                    f"toolCallFormat {reader} (or auto), which reads them")
        return (f"toolCallFormat {fmt}: the tokenizer's chat template writes {what}, which Kiln's chat "
                "formats (hermes, llama3, glm45) do not read; use toolCallFormat tags, or a tokenizer "
                "whose template writes hermes, llama3 or glm45 tool calls")
    return None
