"""The rollout formats: tool-call parsing per family, the chat template's conversations kept
token-exact, and the tags protocol the quickstart uses.

The token-exactness test uses a tokenizer that merges across the end of a tool call (its BPE
learned `"}</tool_call>`-style merges), so re-tokenizing a decoded reply would give other ids
than the ones sampled; the trajectory must carry the sampled ones.
"""
from __future__ import annotations

import asyncio

import pytest
from transformers import AutoTokenizer

from kiln.env import ToolCall, string_tool
from kiln.episode import EpisodeInfo, Message, StepResult, ToolOutput
from kiln.models.tiny import CHAT_TOKENS, CHAT_TEMPLATE, CHAT_TEMPLATE_WITH_TOOLS, train_tokenizer
from kiln.services.rollout.agent import Limits, run_episode
from kiln.services.rollout.engine import SamplingOptions
from kiln.services.rollout.formats import choose_format, make_format
from kiln.services.rollout.formats import toolcalls

from helpers.scripted import BASH, EPISODE, OneCallEnv, ScriptedEngine

STEP = string_tool("step", "Apply the step.", value="a value")
STEP.parameters["properties"]["value"]["pattern"] = r"^-?[0-9]{1,12}$"


@pytest.fixture(scope="module")
def chat_tok(tmp_path_factory):
    # No special tool-call tokens: the tool-call markup is learned text, so BPE merges reach
    # across the end of a call.
    corpus = [f'<tool_call>{{"name": "bash", "arguments": {{"command": "ls {i}"}}}}</tool_call>'
              for i in range(300)] + ["Count the files.", "exit code 0"] * 50
    d = train_tokenizer(corpus, tmp_path_factory.mktemp("tok") / "chat", vocab_size=420,
                        special_tokens=list(CHAT_TOKENS), chat_template=CHAT_TEMPLATE_WITH_TOOLS)
    return AutoTokenizer.from_pretrained(str(d))


# ------------------------------------------------------------------------------ tool calls


def test_hermes_calls_content_and_problems():
    a = toolcalls.parse('Let me look.\n<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}'
                        '\n</tool_call>', "hermes", [BASH])
    assert not a.unparseable and a.content == "Let me look."
    assert [(c.name, c.arguments) for c in a.tool_calls] == [("bash", {"command": "ls"})]
    two = toolcalls.parse('<tool_call>{"name": "bash", "arguments": {"command": "a"}}</tool_call>'
                          '<tool_call>{"name": "bash", "arguments": "{\\"command\\": \\"b\\"}"}</tool_call>',
                          "hermes", [BASH])
    assert [c.arguments["command"] for c in two.tool_calls] == ["a", "b"]
    answer = toolcalls.parse("The answer is 4.", "hermes", [BASH])
    assert answer.tool_calls == [] and answer.content == "The answer is 4." and not answer.unparseable
    for text, problem in [
        ('<tool_call>{"name": "bash", "arguments": {"command": "ls"}}', "not closed"),
        ("<tool_call>{name: bash}</tool_call>", "not JSON"),
        ('<tool_call>{"name": "rm", "arguments": {}}</tool_call>', "unknown tool 'rm'"),
        ('<tool_call>{"name": "bash", "arguments": {}}</tool_call>', "lacks 'command'"),
        ('<tool_call>{"name": "bash", "arguments": {"command": 3}}</tool_call>', "must be a string"),
        ('<tool_call>["bash"]</tool_call>', "JSON object with a string `name`"),
    ]:
        got = toolcalls.parse(text, "hermes", [BASH])
        assert got.unparseable and problem in got.problem, (text, got.problem)
    bad = toolcalls.parse('<tool_call>{"name": "step", "arguments": {"value": "x1"}}</tool_call>',
                          "hermes", [STEP])
    assert bad.unparseable and "does not match" in bad.problem


def test_llama3_calls():
    a = toolcalls.parse('<|python_tag|>{"name": "bash", "parameters": {"command": "pwd"}}', "llama3", [BASH])
    assert [(c.name, c.arguments) for c in a.tool_calls] == [("bash", {"command": "pwd"})]
    assert toolcalls.parse("It is 4.", "llama3", [BASH]).content == "It is 4."
    assert toolcalls.parse('{"name": "bash"', "llama3", [BASH]).unparseable


@pytest.mark.parametrize("fmt", toolcalls.FORMATS)
def test_render_parses_back(fmt):
    calls = [ToolCall("bash", {"command": "wc -l *.txt"})]
    got = toolcalls.parse(toolcalls.render(calls, "", fmt), fmt, [BASH])
    assert [(c.name, c.arguments) for c in got.tool_calls] == [("bash", {"command": "wc -l *.txt"})]


def test_choose_format_follows_the_chat_template(chat_tok, tmp_path):
    assert choose_format("auto", chat_tok, "qwen2") == "hermes"
    assert choose_format("auto", chat_tok, "llama") == "llama3"
    plain = AutoTokenizer.from_pretrained(str(train_tokenizer(["a b"] * 5, tmp_path / "t", vocab_size=300,
                                                              chat_template=CHAT_TEMPLATE)))
    assert choose_format("auto", plain, "qwen2") == "tags"
    assert choose_format("llama3", plain) == "llama3"
    with pytest.raises(ValueError, match="not one of"):
        choose_format("mistral", plain)


# ---------------------------------------------------------------------- chat conversations


def test_trajectory_tokens_are_the_sampled_ones_across_a_tool_call_boundary(chat_tok):
    fmt = make_format("hermes", chat_tok)
    call = '<tool_call>{"name": "bash", "arguments": {"command": "ls 7"}}</tool_call>'
    cut = call.index("}</tool_call>") + 1
    # Sampled as two pieces split inside a merge the tokenizer would make.
    sampled = (chat_tok.encode(call[:cut], add_special_tokens=False)
               + chat_tok.encode(call[cut:], add_special_tokens=False) + [chat_tok.eos_token_id])
    retokenized = chat_tok.encode(call, add_special_tokens=False) + [chat_tok.eos_token_id]
    assert sampled != retokenized  # the case this test is about
    answer = chat_tok.encode("3", add_special_tokens=False) + [chat_tok.eos_token_id]
    engine, env = ScriptedEngine([sampled, answer]), OneCallEnv()
    [traj] = asyncio.run(run_episode(engine, env, fmt, task_set="t", index=0,
                                   sampling=SamplingOptions(), limits=Limits(max_turns=4)))
    assert [(c.name, c.arguments) for c in env.actions[0].tool_calls] == [("bash", {"command": "ls 7"})]
    assert env.actions[1].content == "3" and traj.reward == 1.0
    # The trained tokens are exactly the sampled ones, in order.
    trained = [t for t, m in zip(traj.tokens, traj.loss_mask) if m]
    assert trained == sampled + answer
    second_prompt = engine.prompts[1]
    assert second_prompt[len(engine.prompts[0]):len(engine.prompts[0]) + len(sampled)] == sampled
    # What the model saw decodes to the template's own rendering of the conversation.
    rendered = chat_tok.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Count the files."},
         {"role": "assistant", "content": call}, {"role": "tool", "content": "exit code 0\nstdout:\n3"}],
        tools=[BASH.to_openai()], add_generation_prompt=True, tokenize=False)
    assert chat_tok.decode(second_prompt, skip_special_tokens=False) == rendered
    traj.check()
    assert all(v == 3 for v, m in zip(traj.versions_per_token(), traj.loss_mask) if m)


def test_thinking_off_prefixes_an_empty_think_block(chat_tok):
    fmt = make_format("hermes", chat_tok, thinking="off")
    conv = fmt.conversation(EPISODE)
    assert chat_tok.decode(conv.action_prefix()) == "<think>\n\n</think>\n\n"


class CallsEnv(OneCallEnv):
    """Bash calls until the model answers."""

    async def step(self, episode_id, action):
        self.actions.append(action)
        if action.tool_calls:
            return StepResult([ToolOutput(c.id, c.name, f"out{len(self.actions)}") for c in action.tool_calls])
        return StepResult(done=True, reward=1.0)


def test_turn_level_thinking_drops_thoughts_and_starts_a_segment(chat_tok):
    fmt = make_format("hermes", chat_tok, thinking="turn-level", think_every=2)
    enc = lambda text: chat_tok.encode(text, add_special_tokens=False)  # noqa: E731
    call = '<tool_call>{"name": "bash", "arguments": {"command": "ls 1"}}</tool_call>'
    eos = [chat_tok.eos_token_id]
    replies = [enc("<think>plan A</think>\n\n" + call) + eos,   # turn 0 thinks
               enc(call) + eos,                                 # turn 1: empty block written
               enc("<think>plan B</think>\n\n" + call) + eos,   # turn 2 thinks (every 2nd)
               enc("3") + eos]
    engine, env = ScriptedEngine([list(r) for r in replies]), CallsEnv()
    trajs = asyncio.run(run_episode(engine, env, fmt, task_set="t", index=0,
                                    sampling=SamplingOptions(), limits=Limits(max_turns=6)))
    # A new segment after each turn that thought: [turn 0], [turns 1-2], [turn 3].
    assert [t.flags for t in trajs] == [["segment:0"], ["segment:1"], ["segment:2"]]
    trained = [[tok for tok, m in zip(t.tokens, t.loss_mask) if m] for t in trajs]
    assert trained == [replies[0], replies[1] + replies[2], replies[3]]
    seen = [chat_tok.decode(p, skip_special_tokens=False) for p in engine.prompts]
    assert "plan A" not in seen[1] and "plan A" not in seen[2] and "plan B" not in seen[3]
    # Turn 1 was told not to think; turn 2 was free to.
    assert seen[1].endswith("<think>\n\n</think>\n\n") and not seen[2].endswith("</think>\n\n")
    for t, prompt in zip(trajs, (engine.prompts[0], engine.prompts[1], engine.prompts[3])):
        t.check()
        assert t.tokens[:len(prompt)] == prompt and t.reward == 1.0  # exactly what was seen
    assert all(t.group_id == trajs[0].group_id for t in trajs)


def test_turn_level_thinking_needs_a_chat_template(chat_tok):
    with pytest.raises(ValueError, match="turn-level"):
        make_format("tags", chat_tok, thinking="turn-level")


def test_a_template_that_rewrites_earlier_turns_is_refused(chat_tok):
    class Dropping:
        """Wraps the tokenizer with a template that drops earlier replies' content."""

        def __init__(self, tok):
            self.tok = tok
            self.chat_template = tok.chat_template
            self.eos_token, self.eos_token_id = tok.eos_token, tok.eos_token_id

        def apply_chat_template(self, messages, **kw):
            msgs = [dict(m, content="...") if m["role"] == "assistant" else m for m in messages]
            return self.tok.apply_chat_template(msgs, **kw)

        def __getattr__(self, name):
            return getattr(self.tok, name)

    fmt = make_format("hermes", Dropping(chat_tok))
    conv = fmt.conversation(EPISODE)
    conv.prompt()
    conv.read_reply(chat_tok.encode("hello", add_special_tokens=False) + [chat_tok.eos_token_id])
    with pytest.raises(ValueError, match="does not write an assistant reply as sampled"):
        conv.observation([ToolOutput("", "bash", "out")])


def test_demonstration_renders_replies_in_the_family_format(chat_tok):
    from kiln.episode import Demonstration, Turn
    from kiln.services.rollout.formats import demonstration_tokens

    fmt = make_format("hermes", chat_tok)
    demo = Demonstration("t1", EPISODE.messages, EPISODE.tools, [
        Turn("", [ToolCall("bash", {"command": "ls"})], [ToolOutput("", "bash", "a b")]),
        Turn("2", [], [])], 1.0, "ok")
    tokens, mask, prompt_len = demonstration_tokens(fmt, demo)
    trained = chat_tok.decode([t for t, m in zip(tokens, mask) if m], skip_special_tokens=False)
    assert trained == ('<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>'
                       "<|im_end|>2<|im_end|>")
    untrained = chat_tok.decode([t for t, m in zip(tokens[prompt_len:], mask[prompt_len:]) if not m])
    assert "<|im_start|>tool\na b<|im_end|>" in untrained


# ------------------------------------------------------------------------------------ tags


def test_tags_format_reads_calls_answers_and_writes_outputs(tmp_path):
    from kiln.services.sandbox.environments import chain

    tok = AutoTokenizer.from_pretrained(str(train_tokenizer(
        chain.corpus_for_tokenizer(50), tmp_path / "tags", vocab_size=300,
        special_tokens=list(chain.SPECIAL_TOKENS))))
    fmt = make_format("tags", tok)
    episode = EpisodeInfo("e", "t", "chain", [Message("user", "<task>37 *7%97+5 x1</task>")],
                          chain.ChainEnvironment().tools(None))
    conv = fmt.conversation(episode)
    assert tok.decode(conv.prompt()) == "<task>37 *7%97+5 x1</task>"
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    call = conv.read_reply(enc("<think>easy</think><call>step 37</call>"))
    assert [(c.name, c.arguments) for c in call.tool_calls] == [("step", {"value": "37"})]
    assert conv.read_reply(enc("<call>calc 2 * 3</call>")).tool_calls[0].arguments == {"expression": "2 * 3"}
    assert conv.read_reply(enc("<answer>70</answer>")).content == "70"
    for text in ("hello</call>", "<call>jump 3</call>", "<call>step 3 4</call>"):
        assert conv.read_reply(enc(text)).unparseable, text
    assert tok.decode(conv.observation([ToolOutput("", "step", "70")])) == "<obs>70</obs>"
    assert [tok.decode([i]) for i in fmt.stop_token_ids] == ["</call>", "</answer>"]
    assert tok.decode(fmt.reply_ids("", [ToolCall("step", {"value": "70"})])) == "<call>step 70</call>"
