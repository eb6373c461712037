"""An in-process OpenAI endpoint for the tests that drive it as clients do: the server on the
plain-transformers engine and the tiny tool-calling model, or on a scripted engine that fails on
cue (a real one cannot be made to die on demand)."""
from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
from openai import AsyncOpenAI
from transformers import AutoTokenizer

from kiln.services.rollout.engine import EngineBase, EngineSettings, Generation
from kiln.services.rollout.formats import make_format
from kiln.services.rollout.openai_auth import ApiKeys
from kiln.services.rollout.openai_episodes import ExternalEpisodes
from kiln.services.rollout.openai_server import OpenAIServer
from kiln.services.rollout.torch_engine import TorchEngine

KEY, OTHER = "test-key-0123456789abcdef", "other-key-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {KEY}"}


class Scripted(EngineBase):
    """An engine that answers "Done." (and whatever `extra` tokens) and can fail on cue: raise on
    chosen calls, die (its `failure` says so) or hang. Stands in for vLLM where the point is
    how the endpoint takes an engine's failure."""

    def __init__(self, model_dir: Path, tok) -> None:
        super().__init__(EngineSettings(model=str(model_dir)), "scripted")
        self.reply = tok.encode("Done.", add_special_tokens=False) + [tok.convert_tokens_to_ids("<|im_end|>")]
        self.calls, self.fail_on, self.dead, self.hang = 0, set(), "", asyncio.Event()
        self.hanging = False

    def failure(self) -> str:
        return self.dead

    async def generate(self, prompt, sampling) -> Generation:
        self.calls += 1
        if self.hanging:
            await self.hang.wait()
        if self.calls in self.fail_on:
            raise RuntimeError("engine step failed")
        return Generation(list(self.reply), [0.0] * len(self.reply), [0] * len(self.reply), "stop")

    async def close(self) -> None:
        self.hang.set()


def serve(model_dir: Path, scenario, *, scripted: bool = False, **server_kw):
    """Run `await scenario(client, http, ctx)` against an in-process server; its result. `ctx`:
    the server, the engine and the stored (trajectory, group size) pairs."""
    async def main():
        tok = AutoTokenizer.from_pretrained(str(model_dir))
        engine = (Scripted(model_dir, tok) if scripted else
                  await TorchEngine.start(EngineSettings(model=str(model_dir), dtype="float32")))
        stored: list = []

        async def sink(trajs, size):
            stored.extend((t, size) for t in trajs)

        episodes = ExternalEpisodes(engine, make_format("hermes", tok), sink, max_tokens_per_turn=40,
                                    max_total_tokens=400)
        server = OpenAIServer(episodes, model_name="tiny", tokenizer=tok, keys=ApiKeys({KEY: "t", OTHER: "o"}),
                              **server_kw)
        port = await server.start()
        base = f"http://127.0.0.1:{port}/v1"
        try:
            async with AsyncOpenAI(base_url=base, api_key=KEY, max_retries=0) as client, \
                    httpx.AsyncClient(base_url=base, headers=AUTH, timeout=60) as http:
                return await scenario(client, http, {"server": server, "engine": engine,
                                                     "stored": stored, "tok": tok,
                                                     "health": f"http://127.0.0.1:{port}/healthz"})
        finally:
            await server.stop()
            await engine.close()
    return asyncio.run(main())
