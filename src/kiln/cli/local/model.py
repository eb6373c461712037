"""Creating a job's tiny local model (`spec.model.init`): a tokenizer learned from the job's own
episodes, and a randomly initialised checkpoint of the asked shape. Nothing is downloaded.

The tokenizer's corpus is what the model will read and write: each environment's corpus (its
prompts, tools, scripted solutions and their outputs) and, for a chat format, those episodes
rendered by the chat template itself, with the template's special tokens cut out (they are
added as tokens, not learned as merges). A job in the `tags` format gets the plain ChatML
template and the tags as tokens, a chat job the tool-calling template (`CHAT_TEMPLATE_WITH_TOOLS`)
and merges learned under the word splitting its loaded tokenizer applies, plus one token for each
tool's call opening (`call_openers`). Words an environment wants whole (`tokenizer_words`: the
terminal quickstart's numbers) are tokens too.
"""
from __future__ import annotations

import os
import random
import re
import sys
import tempfile
import time
from pathlib import Path

from kiln.api.spec import RLJob
from kiln.api.task_sources import TASKS_ROOT_ENV

#: Scripted episodes rendered per environment for the tokenizer's corpus.
RENDERED_EPISODES = 500


def _environments(job: RLJob) -> list[tuple[object, list]]:
    """(environment, its tasks over every task set) per environment type of the job."""
    from kiln.services.sandbox.episodes import load_task_set

    by_env: dict[type, tuple[object, list]] = {}
    for ts in job.spec.tasks:
        # In a pod, the task sets a cluster keeps are mounted where the operator says.
        loaded = load_task_set(ts, Path.cwd(), os.environ.get(TASKS_ROOT_ENV))
        env, tasks = by_env.setdefault(type(loaded.environment), (loaded.environment, []))
        tasks += loaded.tasks
    return list(by_env.values())


def _rendered_episodes(envs: list[tuple[object, list]], template: str, cut: list[str],
                       fmt: str) -> list[str]:
    """Scripted episodes as the chat template writes them, split at the template's tokens."""
    from transformers import AutoTokenizer

    from kiln.models.tiny import train_tokenizer
    from kiln.services.rollout.formats import toolcalls

    with tempfile.TemporaryDirectory() as tmp:
        renderer = AutoTokenizer.from_pretrained(str(train_tokenizer(
            ["x"], Path(tmp), vocab_size=300, chat_template=template)))
    pieces = re.compile("|".join(re.escape(t) for t in sorted(cut, key=len, reverse=True)))
    rng, texts = random.Random(0), []
    for env, tasks in envs:
        for task in tasks[:RENDERED_EPISODES]:
            turns = env.demonstrate(task, rng)
            if turns is None:
                continue
            system = env.system_prompt(task)
            messages = ([{"role": "system", "content": system}] if system else []) + [
                {"role": "user", "content": env.user_prompt(task)}]
            for turn in turns:
                messages.append({"role": "assistant",
                                 "content": toolcalls.render(turn.tool_calls, turn.content, fmt)})
                messages += [{"role": "tool", "content": o} for o in (turn.outputs or [])]
            text = renderer.apply_chat_template(messages, tools=[t.to_openai() for t in env.tools(task)],
                                                tokenize=False)
            texts += [p for p in pieces.split(text) if p]
    return texts


def call_openers(envs: list[tuple[object, list]], fmt: str) -> list[str]:
    """Each tool's call as the format writes it, up to its first argument's value (the whole
    call for a tool without arguments), and the rest after a string value: one token each in the
    tiny tokenizer. A word-splitting tokenizer cannot merge JSON punctuation into words, so
    without them a call's framing is a dozen tokens, and a tiny model must learn to copy a tool's
    output across all of them (see docs/quickstart-notes.md)."""
    from kiln.env import ToolCall
    from kiln.services.rollout.formats import toolcalls

    mark, found = "KILN-ARGUMENT-VALUE", []  # plain ASCII: JSON writes it as it is
    for env, tasks in envs:
        for tool in env.tools(tasks[0]) if tasks else []:
            args = list(tool.parameters.get("properties", {}))
            call = ToolCall(tool.name, {args[0]: mark} if args else {})
            text = toolcalls.render([call], "", fmt)
            found += text.split(mark) if args else [text]
    return list(dict.fromkeys(t for t in found if t))


def prepare_model(job: RLJob, out=sys.stdout) -> None:
    """Get the job's model to `spec.model.path` if it asks for one: download it from the Hub
    (`spec.model.hub`; raises `hub.HubError`) or create it (`spec.model.init`), unless it is
    there already."""
    path = job.spec.model.local_path()
    if job.spec.model.hub is not None:
        from kiln.cli.local.hub import download

        download(job.spec.model.hub, path, out)
        return
    if (path / "config.json").exists():
        return
    init = job.spec.model.init
    if init is None:
        raise ValueError(f"spec.model.path: {path} holds no config.json, and neither "
                         "spec.model.init nor spec.model.hub is set to get one there")
    from kiln.models.tiny import (CHAT_TEMPLATE, CHAT_TEMPLATE_WITH_TOOLS, DEFAULT_SPECIAL_TOKENS,
                                  make_tiny_model, train_tokenizer)
    from kiln.services.sandbox.environments.chain import SPECIAL_TOKENS as TAGS

    t0 = time.monotonic()
    envs = _environments(job)
    texts = [t for env, tasks in envs for t in env.tokenizer_corpus(tasks[:2000])]
    words = [w for env, tasks in envs for w in env.tokenizer_words(tasks)]
    tags = job.spec.rollout.tool_call_format == "tags"
    if tags:
        special, template = list(TAGS) + words, CHAT_TEMPLATE
    else:
        fmt = "llama3" if job.spec.rollout.tool_call_format == "llama3" else "hermes"
        special = list(DEFAULT_SPECIAL_TOKENS) + call_openers(envs, fmt) + words
        template = CHAT_TEMPLATE_WITH_TOOLS
        texts += _rendered_episodes(envs, template, special, fmt)
    tok_dir = path.with_name(path.name + ".tokenizer")
    # Pad the vocabulary only as far as tensor parallelism needs: unused tokens slow a tiny
    # tied-embedding model's learning (see train_tokenizer).
    train_tokenizer(texts, tok_dir, vocab_size=init.vocab_size, special_tokens=special,
                    chat_template=template, split_digits=True,
                    pre_tokenization="gpt2" if tags else "qwen2",
                    pad_to_multiple=job.spec.trainer.tensor_parallel)
    make_tiny_model(path, tok_dir, arch=init.arch, hidden_size=init.hidden_size,
                    num_layers=init.num_layers, num_heads=init.num_heads,
                    num_kv_heads=init.num_kv_heads, intermediate_size=init.intermediate_size,
                    max_position_embeddings=init.max_position_embeddings, seed=init.seed,
                    tie_word_embeddings=init.tie_word_embeddings,
                    dtype=job.spec.model.dtype, perturb_norms=False,
                    num_experts=init.num_experts, num_experts_per_tok=init.num_experts_per_tok,
                    moe_intermediate_size=init.moe_intermediate_size,
                    shared_expert_intermediate_size=init.shared_expert_intermediate_size,
                    index_topk=init.index_topk)
    out.write(f"created model {path} ({time.monotonic() - t0:.1f} s)\n")
