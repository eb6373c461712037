"""`kiln serve MODEL_DIR --openai-port PORT`: a checkpoint behind the OpenAI chat-completions
API, to try an agent scaffold against it.

The rollout engine (vLLM, or the trainer's model code for DSA checkpoints) serves
`http://127.0.0.1:PORT/v1` to callers with a key of `--api-key-file FILE` (one per line, sent
as `Authorization: Bearer KEY`); `POST /v1/kiln/episodes` opens an episode, each request names
it in an `X-Kiln-Episode` header (a request naming none gets one issued, in that response
header), and `POST /v1/kiln/episodes/ID/reward` ends it, appending its trajectories to
`--trajectories FILE` when given. Stops cleanly on SIGTERM or Ctrl-C; exits 2 when the engine
dies or wedges. The API is described in `kiln.services.rollout.openai_server`.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from pathlib import Path

from kiln.cli.exits import Exit


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve", help="serve a checkpoint behind the OpenAI chat-completions API",
        description="Serve a Hugging Face checkpoint with Kiln's rollout engine behind the OpenAI "
                    "chat-completions API (tools included), so that an agent scaffold can act "
                    "as the policy; rewarded episodes become trajectories.")
    p.add_argument("model_dir", type=Path, metavar="MODEL_DIR", help="Hugging Face checkpoint directory")
    p.add_argument("--openai-port", type=int, required=True,
                   help="port of the OpenAI endpoint (0: any free port, printed on start)")
    p.add_argument("--api-key-file", type=Path, required=True, metavar="FILE",
                   help="file of the API keys callers must send (one per line, 16 characters "
                        "at least), as 'Authorization: Bearer KEY'")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--engine", choices=("auto", "vllm", "megatron", "torch"), default="auto",
                   help="inference engine (auto: vllm, or megatron for DSA checkpoints)")
    p.add_argument("--tool-call-format", choices=("auto", "hermes", "llama3", "glm45"), default="auto",
                   help="tool-call syntax (auto: from the model's family and chat template)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                   help="dtype the engine runs in (default float32)")
    p.add_argument("--max-tokens-per-turn", type=int, default=512,
                   help="upper bound on one reply's tokens, whatever a request asks (default 512)")
    p.add_argument("--trajectories", type=Path, default=None,
                   help="JSONL file that rewarded episodes' trajectories are appended to")
    p.add_argument("--ready-file", type=Path, default=None,
                   help="file to write {port, format} to once the endpoint listens (for scripts)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kiln.api.capabilities import model_problems
    from kiln.services.rollout.engine import engine_kind

    if not (args.model_dir / "config.json").is_file():
        print(f"kiln serve: {args.model_dir} holds no config.json (expected a Hugging Face "
              "checkpoint directory)", file=sys.stderr)
        return Exit.REFUSED
    kind = engine_kind(args.engine, args.model_dir)
    problems = model_problems(args.model_dir, engine=kind, dtype=args.dtype)
    if problems:
        print(f"kiln serve: {args.model_dir}: {problems[0]}", file=sys.stderr)
        return Exit.REFUSED
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    from kiln.services.rollout.standalone import serve
    try:
        died = asyncio.run(serve(
            args.model_dir, port=args.openai_port, api_key_file=args.api_key_file,
            host=args.host, engine=kind, tool_call_format=args.tool_call_format, dtype=args.dtype,
            max_tokens_per_turn=args.max_tokens_per_turn, trajectories=args.trajectories,
            ready_file=args.ready_file))
    except (ValueError, OSError) as exc:
        print(f"kiln serve: {exc}", file=sys.stderr)
        return Exit.REFUSED
    return Exit.FAILED if died else Exit.OK  # serve: 1 when the engine died or wedged
