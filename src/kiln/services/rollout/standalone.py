"""The rollout engine on a checkpoint alone, behind the OpenAI endpoint (`kiln serve`): for
pointing an agent scaffold at a model before (or after) training it.

No trainer, buffer or weight sync: the policy version stays the checkpoint's. Rewarded episodes
are appended to a JSONL file of trajectories when one is given (`Trajectory.to_dict` per line),
in the form a trainer takes them.
"""
from __future__ import annotations

import asyncio
import json
import logging
import signal
import sys
from pathlib import Path

from kiln.files import write_json_whole
from kiln.trajectory import Trajectory

log = logging.getLogger("kiln.serve")


def renders_tools(tokenizer) -> bool:
    """Whether the tokenizer's chat template writes a request's tools into the prompt."""
    probe = {"type": "function", "function": {"name": "kiln_probe_tool", "description": "probe",
                                              "parameters": {"type": "object", "properties": {}}}}
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tools=[probe],
                                             tokenize=False, add_generation_prompt=True)
    except Exception:  # no template, or one that fails on tools: it does not render them
        return False
    return "kiln_probe_tool" in text


async def serve(model_dir: Path, *, port: int, api_key_file: Path, host: str = "127.0.0.1",
                engine: str = "auto",
                tool_call_format: str = "auto", dtype: str = "float32",
                kv_cache_bytes: int = 256 << 20, max_tokens_per_turn: int = 512,
                max_total_tokens: int = 0, trajectories: Path | None = None,
                ready_file: Path | None = None) -> int:
    """Serve until SIGTERM or SIGINT, then stop the engine and return 0; or until the engine
    dies or wedges, then return 1 (a supervisor restarts the process)."""
    from transformers import AutoTokenizer

    from kiln.services.rollout.engine import EngineSettings, engine_kind, start_engine
    from kiln.services.rollout.formats import choose_format, make_format
    from kiln.services.rollout.openai_auth import ApiKeys
    from kiln.services.rollout.openai_episodes import ExternalEpisodes
    from kiln.services.rollout.openai_server import OpenAIServer

    keys = ApiKeys.load(api_key_file)  # before the engine loads: a bad key file fails fast
    config = json.loads((model_dir / "config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    name = choose_format(tool_call_format, tokenizer, config.get("model_type", ""))
    if name == "tags" or not renders_tools(tokenizer):
        # A template that ignores `tools` would drop every request's tools from the prompt
        # without a word; the model would never be told what it may call.
        raise ValueError(f"{model_dir}: its chat template does not render tools, so a request's "
                         "`tools` would never reach the model; the OpenAI endpoint needs a "
                         "checkpoint whose template renders them (as Qwen's and Llama 3.1's do)")
    fmt = make_format(name, tokenizer)
    max_len = config.get("max_position_embeddings") or 4096
    eng = await start_engine(engine_kind(engine, model_dir), EngineSettings(
        model=str(model_dir), dtype=dtype, kv_cache_bytes=kv_cache_bytes))  # type: ignore[arg-type]

    async def sink(trajs: list[Trajectory], group_size: int) -> None:
        if trajectories is None:
            return
        with open(trajectories, "a") as f:
            for t in trajs:
                f.write(json.dumps({"group_size": group_size, **t.to_dict()}) + "\n")

    episodes = ExternalEpisodes(eng, fmt, sink, max_tokens_per_turn=max_tokens_per_turn,
                                max_total_tokens=max_total_tokens or max_len)
    stop = asyncio.Event()
    server = OpenAIServer(episodes, model_name=model_dir.name, tokenizer=tokenizer, keys=keys,
                          host=host, port=port, on_dead=lambda _reason: stop.set())
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        bound = await server.start()
        if ready_file is not None:
            write_json_whole(ready_file, {"port": bound, "format": name})
        print(f"kiln serve: {model_dir} ({name} tool calls) at http://{host}:{bound}/v1", flush=True)
        await stop.wait()
    finally:
        await server.stop()
        await eng.close()
        log.info("stopped; %d episodes were open", len(episodes))
    if server.dead:
        print(f"kiln serve: exiting: {server.dead}", file=sys.stderr, flush=True)
        return 1
    return 0
