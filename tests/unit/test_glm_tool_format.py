"""GLM-4.5's tool calls (`toolCallFormat: glm45`): `<tool_call>NAME<arg_key>K</arg_key>
<arg_value>V</arg_value></tool_call>`, values read by the tool's schema, a reply ending where the
model hands over to the tools (`<|observation|>`) or the user (`<|user|>`), and an agent episode
kept token-exact through a GLM-style chat template (thoughts split off and re-joined, tool
outputs after `<|observation|>`), as GLM-4.5's own template renders them."""
from __future__ import annotations

import asyncio

import pytest
from transformers import AutoTokenizer

from kiln.env import ToolCall, ToolSpec, string_tool
from kiln.services.rollout.agent import Limits, run_episode
from kiln.services.rollout.engine import SamplingOptions
from kiln.services.rollout.formats import choose_format, demonstration_tokens, make_format
from kiln.services.rollout.formats import toolcalls
from kiln.models.tiny import CHAT_TOKENS, train_tokenizer
from kiln.episode import Demonstration, Message, ToolOutput, Turn

from helpers.scripted import BASH, OneCallEnv, ScriptedEngine

GLM_TOKENS = ["[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"]
# Written for this test after GLM-4.5's layout: the tools in a system block, each assistant turn
# re-rendered as `\n<think>THOUGHT</think>` and its stripped text, tool outputs after one
# `<|observation|>`, and a bare `<|assistant|>` to generate after.
GLM_TEMPLATE = (
    "[gMASK]<sop>{%- if tools -%}<|system|>\n# Tools\nCall a tool as <tool_call>NAME"
    "<arg_key>KEY</arg_key><arg_value>VALUE</arg_value></tool_call>.\n<tools>\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools>{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'system' -%}<|system|>\n{{ m.content }}"
    "{%- elif m.role == 'user' -%}<|user|>\n{{ m.content }}"
    "{%- elif m.role == 'assistant' -%}<|assistant|>{%- set text = m.content or '' -%}"
    "{%- if '</think>' in text -%}"
    "{{ '\\n<think>' + text.split('</think>')[0].split('<think>')[-1].strip() + '</think>' }}"
    "{%- set text = text.split('</think>')[-1] -%}{%- else -%}{{ '\\n<think></think>' }}{%- endif -%}"
    "{%- if text.strip() -%}{{ '\\n' + text.strip() }}{%- endif -%}"
    "{%- elif m.role == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}<|observation|>{%- endif -%}"
    "{{ '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
    "{%- endif -%}{%- endfor -%}{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}")
COUNT = ToolSpec("count", "Count lines.", {
    "type": "object", "properties": {"path": {"type": "string"}, "limit": {"type": "integer"},
                                     "flags": {"type": "array"}}, "required": ["path"]})


@pytest.fixture(scope="module")
def glm_tok(tmp_path_factory):
    corpus = ["<tool_call>bash\n<arg_key>command</arg_key>\n<arg_value>ls %d</arg_value>\n"
              "</tool_call>" % i for i in range(200)] + ["Count the files.", "exit code 0"] * 50
    d = train_tokenizer(corpus, tmp_path_factory.mktemp("tok") / "glm", vocab_size=420,
                        special_tokens=[*CHAT_TOKENS, *GLM_TOKENS], chat_template=GLM_TEMPLATE)
    return AutoTokenizer.from_pretrained(str(d))


def test_calls_are_read_by_the_tools_schema():
    text = ("Counting.\n<tool_call>count\n<arg_key>path</arg_key>\n<arg_value>42</arg_value>\n"
            "<arg_key>limit</arg_key>\n<arg_value>7</arg_value>\n<arg_key>flags</arg_key>\n"
            '<arg_value>["-l", "é"]</arg_value>\n</tool_call>')
    a = toolcalls.parse(text, "glm45", [COUNT])
    assert not a.unparseable, a.problem
    # "42" stays a string (the schema says so); 7 and the list are JSON.
    assert [(c.name, c.arguments) for c in a.tool_calls] == [
        ("count", {"path": "42", "limit": 7, "flags": ["-l", "é"]})]
    assert a.content == "Counting."
    back = toolcalls.parse(toolcalls.render(a.tool_calls, "", "glm45"), "glm45", [COUNT])
    assert [(c.name, c.arguments) for c in back.tool_calls] == [(c.name, c.arguments) for c in a.tool_calls]
    two = toolcalls.parse("<tool_call>bash<arg_key>command</arg_key><arg_value>a</arg_value></tool_call>"
                          "<tool_call>bash<arg_key>command</arg_key><arg_value>b</arg_value></tool_call>",
                          "glm45", [BASH])
    assert [c.arguments["command"] for c in two.tool_calls] == ["a", "b"]
    for text, problem in [
        ("<tool_call>bash<arg_key>command</arg_key><arg_value>ls</arg_value>", "not closed"),
        ("<tool_call><arg_key>command</arg_key><arg_value>ls</arg_value></tool_call>", "tool's name"),
        ("<tool_call>bash<arg_key>command</arg_key>ls</tool_call>", "pairs"),
        ("<tool_call>count<arg_key>path</arg_key><arg_value>a</arg_value>"
         "<arg_key>limit</arg_key><arg_value>many</arg_value></tool_call>", "must be a integer"),
        ("<tool_call>rm<arg_key>path</arg_key><arg_value>/</arg_value></tool_call>", "unknown tool"),
    ]:
        got = toolcalls.parse(text, "glm45", [COUNT, BASH])
        assert got.unparseable and problem in got.problem, (text, got.problem)


def test_auto_picks_glm45_for_a_glm_template(glm_tok):
    assert choose_format("auto", glm_tok, "glm4_moe") == "glm45"
    fmt = make_format("glm45", glm_tok)
    vocab = glm_tok.get_vocab()
    assert {vocab["<|observation|>"], vocab["<|user|>"]} <= set(fmt.stop_token_ids)


def test_an_episode_through_a_glm_template_is_token_exact(glm_tok):
    fmt = make_format("glm45", glm_tok)

    def ids(text: str, end: str) -> list[int]:
        return glm_tok.encode(text, add_special_tokens=False) + [glm_tok.convert_tokens_to_ids(end)]

    call = ("\n<think>list them</think>\nListing.\n<tool_call>bash\n<arg_key>command</arg_key>\n"
            "<arg_value>ls 7</arg_value>\n</tool_call>")
    sampled, answer = ids(call, "<|observation|>"), ids("\n<think></think>\n3", "<|user|>")
    engine, env = ScriptedEngine([sampled, answer]), OneCallEnv()
    [traj] = asyncio.run(run_episode(engine, env, fmt, task_set="t", index=0,
                                   sampling=SamplingOptions(), limits=Limits(max_turns=4)))
    assert [(c.name, c.arguments) for c in env.actions[0].tool_calls] == [("bash", {"command": "ls 7"})]
    assert env.actions[1].content.endswith("3") and traj.reward == 1.0
    assert [t for t, m in zip(traj.tokens, traj.loss_mask) if m] == sampled + answer
    rendered = glm_tok.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Count the files."},
         {"role": "assistant", "content": call}, {"role": "tool", "content": "exit code 0\nstdout:\n3"}],
        tools=[BASH.to_openai()], add_generation_prompt=True, tokenize=False)
    assert glm_tok.decode(engine.prompts[1], skip_special_tokens=False) == rendered
    traj.check()


def test_a_demonstration_is_written_as_glm_calls(glm_tok):
    fmt = make_format("glm45", glm_tok)
    demo = Demonstration("t1", [Message("user", "List.")], [string_tool("bash", "Run.", command="c")],
                         [Turn("", [ToolCall("bash", {"command": "ls"})], [ToolOutput("", "bash", "a b")]),
                          Turn("3", [])], 1.0, "")
    tokens, mask, _ = demonstration_tokens(fmt, demo)
    trained = glm_tok.decode([t for t, m in zip(tokens, mask) if m], skip_special_tokens=False)
    assert trained == ("\n<think></think>\n<tool_call>bash\n<arg_key>command</arg_key>\n"
                       "<arg_value>ls</arg_value>\n</tool_call><|observation|>\n<think></think>\n3<|user|>")
