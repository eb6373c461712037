"""The OpenAI endpoint called through LiteLLM, as mini-swe-agent and many scaffolds call models
(`litellm.acompletion(model="openai/<name>", api_base=..., api_key=...)`): a tool episode whose
calls LiteLLM parses, a stock client's conversation found again without any Kiln header, and
the endpoint's refusals arriving as LiteLLM's own exception classes, the context overflow as
`ContextWindowExceededError` (which such scaffolds handle by shortening the history, where any
other 400 makes them retry or give up).

In-process server on the plain-transformers engine and the tiny tool-calling model."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

# LiteLLM fetches its model price list at import unless told to use the copy it ships.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
import litellm  # noqa: E402

from helpers.openai_serving import KEY, serve  # noqa: E402
from helpers.toolcall_model import PROMPT, SCRIPT, TOOLS, shared_toolcall_model  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return shared_toolcall_model(tmp_path_factory)


def _kw(http) -> dict:
    return {"model": "openai/tiny", "api_base": str(http.base_url).rstrip("/"), "api_key": KEY,
            "num_retries": 0}


def test_a_tool_episode_through_litellm_is_found_again_turn_after_turn(model_dir: Path) -> None:
    async def scenario(client, http, ctx):
        messages: list[dict] = [{"role": "user", "content": PROMPT}]
        replies = []
        for turn in range(3):
            resp = await litellm.acompletion(messages=messages, tools=TOOLS, temperature=0,
                                             **_kw(http))
            replies.append(resp)
            msg = resp.choices[0].message
            messages.append(msg.model_dump(exclude_none=True))
            for call in msg.tool_calls or []:
                messages.append({"role": "tool", "tool_call_id": call.id,
                                 "content": SCRIPT[min(turn, len(SCRIPT) - 1)][1]})
            if not msg.tool_calls:
                break
        return replies, len(ctx["server"].episodes)

    replies, open_episodes = serve(model_dir, scenario)
    calls = [c.function for r in replies for c in r.choices[0].message.tool_calls or []]
    assert [c.name for c in calls] == ["bash", "bash"]
    assert replies[-1].choices[0].finish_reason == "stop"
    # One issued episode, continued by each call (LiteLLM sends the conversation back as is).
    assert open_episodes == 1


def test_refusals_arrive_as_litellms_own_exceptions(model_dir: Path) -> None:
    async def scenario(client, http, ctx):
        raised = {}
        cases = {"overflow": {"messages": [{"role": "user", "content": "word " * 500}]},
                 "temperature": {"messages": [{"role": "user", "content": PROMPT}], "temperature": 5},
                 "model": {"messages": [{"role": "user", "content": PROMPT}], "model": "openai/gpt-4o"}}
        for name, kw in cases.items():
            try:
                await litellm.acompletion(**{**_kw(http), **kw})
            except Exception as exc:  # noqa: BLE001 — which class LiteLLM raised is the point
                raised[name] = exc
        try:
            await litellm.acompletion(messages=[{"role": "user", "content": PROMPT}],
                                      **{**_kw(http), "api_key": "not-a-key-0123456789"})
        except Exception as exc:  # noqa: BLE001
            raised["key"] = exc
        return raised

    raised = serve(model_dir, scenario, scripted=True)
    assert isinstance(raised["overflow"], litellm.ContextWindowExceededError), raised["overflow"]
    assert isinstance(raised["temperature"], litellm.BadRequestError)
    assert not isinstance(raised["temperature"], litellm.ContextWindowExceededError)
    assert "temperature" in str(raised["temperature"])
    assert isinstance(raised["model"], litellm.NotFoundError)
    assert isinstance(raised["key"], litellm.AuthenticationError)
