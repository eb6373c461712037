"""The chat-template format: the tokenizer's own chat template renders the conversation (with
`tools=`), and replies carry the model family's tool calls (`toolcalls.py`: hermes, llama3,
glm45).

Token exactness. The model's reply tokens are kept as sampled. What follows them is found by
rendering the conversation twice with the template, before and after the tools' outputs, and
tokenizing only the difference: the tail of the assistant message the template writes after
what the model sampled (e.g. the newline after `<|im_end|>`), the tool messages, and the next
reply's header. Earlier replies go into the template as their raw sampled text, so a template
never re-serializes a call differently from how it was sampled. A template that rewrites
earlier turns (one that drops past think blocks, say) cannot be rendered this way; the
conversation says so (ValueError) rather than train on tokens the model did not see.

Turn-level thinking (`thinking="turn-level"`): the model may think on the first turn and every
`think_every`-th one; other turns get the empty think block written before them. After a turn
whose reply thought, its thought is dropped from every later turn's context: the conversation
re-renders the whole context without it (`restarted`), and the agent loop starts a new segment
of the episode there, so each segment is still exactly what the model saw. Empty think blocks
stay where they were written.
"""
from __future__ import annotations

from typing import Any

import re

from kiln.env import ToolCall
from kiln.episode import Action, EpisodeInfo, ToolOutput
from kiln.services.rollout.formats import thinks_on, toolcalls

#: Tokens that end a reply besides the tokenizer's end of text, per format: a GLM reply ends
#: where the model hands over to the tools (`<|observation|>`) or to the user (`<|user|>`).
TURN_ENDS = {"glm45": ("<|observation|>", "<|user|>")}
#: Written before each reply when thinking is off (as Qwen3's template does).
EMPTY_THINK = "<think>\n\n</think>\n\n"
#: Formats whose template writes the empty think block otherwise: GLM's replies are
#: `\n<think>THOUGHT</think>` (empty without a thought), a newline, then the text.
EMPTY_THINKS = {"glm45": "\n<think></think>"}
#: A thought with something in it, and the whitespace after it.
_THOUGHT_RE = re.compile(r"<think>(?!\s*</think>).*?</think>\s*", re.S)


class ChatConversation:
    def __init__(self, fmt: "ChatFormat", episode: EpisodeInfo,
                 history: list[dict[str, Any]] | None = None) -> None:
        """`history`: template messages to open with instead of `episode.messages` (a
        conversation an outside agent began, with earlier turns in it)."""
        self.fmt, self.episode = fmt, episode
        self.messages: list[dict[str, Any]] = (list(history) if history is not None else
                                               [{"role": m.role, "content": m.content}
                                                for m in episode.messages])
        self.tools = [t.to_openai() for t in episode.tools] or None
        self._rendered = self._render(add_generation_prompt=True)
        self._reply_text = ""
        self._calls = 0
        self.turn = 0
        self.restarted = False

    def _render(self, add_generation_prompt: bool) -> str:
        return self.fmt.tokenizer.apply_chat_template(
            self.messages, tools=self.tools, add_generation_prompt=add_generation_prompt,
            tokenize=False)

    def prompt(self) -> list[int]:
        return self.fmt.encode(self._rendered)

    def action_prefix(self) -> list[int]:
        if self.fmt.thinking == "turn-level":
            return [] if thinks_on(self.turn, self.fmt.think_every) else list(self.fmt.empty_think)
        return list(self.fmt.prefix)

    def read_reply(self, token_ids: list[int]) -> Action:
        tok = self.fmt.tokenizer
        raw = tok.decode(self.action_prefix() + list(token_ids), skip_special_tokens=False,
                         clean_up_tokenization_spaces=False)
        self.turn += 1
        self._reply_text = raw
        content = raw
        for end in self.fmt.end_texts:
            if content.endswith(end):
                content = content[: -len(end)]
                break
        self.messages.append({"role": "assistant", "content": content})
        action = toolcalls.parse(content, self.fmt.name, self.episode.tools)
        for call in action.tool_calls:
            self._calls += 1
            call.id = f"call_{self._calls}"
        return action

    def observation(self, outputs: list[ToolOutput]) -> list[int]:
        messages = [{"role": "tool", "content": o.content, "name": o.name,
                     "tool_call_id": o.tool_call_id} for o in outputs]
        self.restarted = False
        if self.fmt.thinking == "turn-level" and _THOUGHT_RE.search(self._reply_text):
            for m in self.messages:
                if m["role"] == "assistant" and m.get("content"):
                    m["content"] = _THOUGHT_RE.sub("", m["content"])
            self.messages.extend(messages)
            self._rendered = self._render(add_generation_prompt=True)
            self._reply_text = ""
            self.restarted = True
            return self.fmt.encode(self._rendered)
        return self.append(messages)

    def append(self, messages: list[dict[str, Any]]) -> list[int]:
        """The tokens that follow the last reply when `messages` (tool results, a user's next
        message) come after it: the rest of the reply's message as the template closes it, the
        messages, and the next reply's header. One rendering of the conversation per call: the
        new tokens are what that rendering holds past the prompt and the reply as the model
        saw them, which is token-exact only where it starts with both (ValueError otherwise,
        and the conversation is left as it was)."""
        self.messages.extend(messages)
        try:
            after = self._render(add_generation_prompt=True)
            if not after.startswith(self._rendered):
                raise ValueError("the chat template renders earlier turns differently once a "
                                 "reply and the messages after it are added; its conversations "
                                 "cannot be kept token-exact")
            written = after[len(self._rendered):]
            if not written.startswith(self._reply_text):
                raise ValueError("the chat template does not write an assistant reply as sampled "
                                 f"(it wrote {written[:80]!r} for {self._reply_text[:80]!r}); its "
                                 "conversations cannot be kept token-exact")
        except BaseException:
            del self.messages[len(self.messages) - len(messages):]
            raise
        self._rendered = after
        return self.fmt.encode(written[len(self._reply_text):])


class ChatFormat:
    def __init__(self, tokenizer: Any, name: str, *, thinking: str = "interleaved",
                 think_every: int = 0) -> None:
        if name not in toolcalls.FORMATS:
            raise ValueError(f"tool-call format {name!r} is not one of {toolcalls.FORMATS}")
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"tool-call format {name}: the tokenizer has no chat template")
        self.tokenizer, self.name = tokenizer, name
        eos = tokenizer.eos_token_id
        self.stop_token_ids = [eos] if eos is not None else []
        self.end_texts = [tokenizer.eos_token] if tokenizer.eos_token else []
        vocab = tokenizer.get_vocab()
        for end in TURN_ENDS.get(name, ()):
            if end not in vocab:
                raise ValueError(f"tool-call format {name}: the tokenizer has no {end} token, "
                                 "which ends this family's replies")
            self.stop_token_ids.append(vocab[end])
            self.end_texts.append(end)
        self.thinking, self.think_every = thinking, think_every
        self.empty_think = self.encode(EMPTY_THINKS.get(name, EMPTY_THINK))
        self.prefix = self.empty_think if thinking == "off" else []

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def conversation(self, episode: EpisodeInfo,
                     history: list[dict[str, Any]] | None = None) -> ChatConversation:
        return ChatConversation(self, episode, history)

    def reply_ids(self, content: str, tool_calls: list[ToolCall]) -> list[int]:
        text = toolcalls.render(tool_calls, content, self.name)
        if self.name == "glm45":
            # A reply without a thought, as GLM writes one: the empty think block (the prefix
            # already holds it when thinking is off), a newline, the text; it hands over to the
            # tools or to the user.
            text = ("\n" if self.prefix else EMPTY_THINKS["glm45"] + "\n") + text
            end = "<|observation|>" if tool_calls else "<|user|>"
            return self.encode(text) + [self.tokenizer.convert_tokens_to_ids(end)]
        return self.encode(text) + self.stop_token_ids[:1]
