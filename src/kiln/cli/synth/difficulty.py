"""`kiln synth difficulty`: play each task of a task set with the current policy (any
OpenAI-compatible endpoint: `kiln serve`, a rollout pod's `openaiPort`, a hosted model), keep
the tasks it solves sometimes but not always, and export the passing episodes as SFT data.

Each task gets `--samples` episodes, each in a fresh sandbox: the environment's system and user
prompts and tools go to `/chat/completions`; every tool call runs through the environment
exactly as in RL (`call_tool`), its output comes back as a `tool` message; the episode ends on a
reply with no tool call (its text is the answer), a tool that ends it (`submit`), or
`--max-turns`; then the environment grades it. A task is kept when its pass rate is strictly
between `--min-rate` and `--max-rate` (default: 0 and 1, i.e. drop never-solved and
always-solved tasks).

Out: `OUT/tasks.jsonl` (the kept records, unchanged), `OUT/difficulty.jsonl` (every task's pass
rate; a re-run skips tasks listed there), `OUT/sft.jsonl` (with `--sft`: one passing episode per
line in the chat fine-tuning format, `messages` + `tools`; an assistant message whose tool call
failed, an `error:` reply or a non-zero exit code, or made an edit the agent later undid, or
undid one (`reverts.py`), carries `"weight": 0` so it is loss-masked), and the report.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import re
import sys
from pathlib import Path

from kiln.cli.exits import Exit

from .report import Report
from .reverts import mask_reverted
from .sandboxes import synth_sandboxes
from .swe import write_json_line

STEPS = ["tasks", "played", "not never-solved", "not always-solved", "kept"]
_FAILED = re.compile(r"^(error:|exit code [1-9]|exit code -|\S+ \(timed out\))")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("taskset", help="a Kiln task set (JSONL)")
    p.add_argument("--model-url", required=True, help="OpenAI-compatible base URL, e.g. "
                   "http://127.0.0.1:8000/v1")
    p.add_argument("--model", default="default", help="model name to request")
    p.add_argument("--samples", type=int, default=8, help="episodes per task (default 8)")
    p.add_argument("--max-turns", type=int, default=16, help="model calls per episode")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    p.add_argument("--max-tokens", type=int, default=1024, help="per model call")
    p.add_argument("--min-rate", type=float, default=0.0, help="keep tasks passing more often")
    p.add_argument("--max-rate", type=float, default=1.0, help="keep tasks passing less often")
    p.add_argument("--sft", action="store_true", help="write the passing episodes to sft.jsonl")
    p.add_argument("--backend", choices=("bubblewrap", "docker"), default="bubblewrap",
                   help="sandbox backend for the checks (default bubblewrap)")
    p.add_argument("--out", required=True, help="output folder")


def run(args: argparse.Namespace) -> int:
    from kiln.services.sandbox.environments.tasks import TaskSetError, load_taskset
    taskset = Path(args.taskset)
    if args.samples < 1 or not 0 <= args.min_rate < args.max_rate <= 1:
        print("kiln synth difficulty: need --samples >= 1 and 0 <= --min-rate < --max-rate <= 1",
              file=sys.stderr)
        return Exit.REFUSED
    try:
        tasks = load_taskset(taskset)
    except (OSError, TaskSetError) as exc:
        print(f"kiln synth difficulty: {exc}", file=sys.stderr)
        return Exit.REFUSED
    records = {}
    for line in taskset.read_text().splitlines():
        if line.strip():
            record = json.loads(line)  # load_taskset above has checked every line
            records[record.get("id") or record.get("instance_id")] = record
    out = Path(args.out)
    report = Report(out, "difficulty", STEPS)
    asyncio.run(_play_all(args, taskset, tasks, records, out, report))
    summary = report.write()
    print(f"kiln synth difficulty: {summary['funnel']['kept']} of {len(tasks)} tasks kept "
          f"-> {out}/tasks.jsonl")
    return 0


async def _play_all(args, taskset: Path, tasks, records: dict, out: Path, report: Report) -> None:
    done = {}
    path = out / "difficulty.jsonl"
    if path.is_file():
        done = {r["id"]: r for r in map(json.loads, path.read_text().splitlines())}
    with synth_sandboxes(args.backend, "synth-difficulty", memory_bytes="2g", disk_bytes="2g") as config:
        await _play_tasks(args, config, taskset, tasks, records, done, out, report)


async def _play_tasks(args, config, taskset: Path, tasks, records: dict, done: dict, out: Path,
                      report: Report) -> None:
    from .drafter import Drafter
    path = out / "difficulty.jsonl"
    model = Drafter(args.model_url, args.model)
    report.count("tasks", len(tasks))
    for n, task in enumerate(tasks, 1):
        report.progress("play", n, len(tasks))
        if task.id in done:
            rate = done[task.id]["pass_rate"]
        else:
            episodes = [await play(config, taskset.parent.resolve(), task, model, args)
                        for _ in range(args.samples)]
            rate = sum(e["reward"] == 1.0 for e in episodes) / len(episodes)
            write_json_line(path, {"id": task.id, "pass_rate": rate, "samples": len(episodes)})
            if args.sft:
                for e in episodes:
                    if e["reward"] == 1.0:
                        write_json_line(out / "sft.jsonl", {"task_id": task.id, **e})
        report.count("played")
        if rate <= args.min_rate:
            report.reject(task.id, "not never-solved", f"pass rate {rate:.2f}")
            continue
        report.count("not never-solved")
        if rate >= args.max_rate:
            report.reject(task.id, "not always-solved", f"pass rate {rate:.2f}")
            continue
        report.count("not always-solved")
        report.count("kept")
        if task.id not in done:
            write_json_line(out / "tasks.jsonl", records[task.id])


async def play(config, base_dir: Path, task, model, args) -> dict:
    """One episode of `task` with the model; its messages, tools and reward."""
    from kiln.env import ToolCall
    from kiln.services.sandbox.environments.tasks import make_environment
    from kiln.services.sandbox.factory import make_sandbox
    env = make_environment(task.type, base_dir)
    tools = [t.to_openai() for t in env.tools(task)]
    messages = ([{"role": "system", "content": env.system_prompt(task)}]
                if env.system_prompt(task) else [])
    messages.append({"role": "user", "content": env.user_prompt(task)})
    box = make_sandbox(config) if env.needs_sandbox else contextlib.nullcontext(None)
    async with box as sandbox:
        await env.setup(sandbox, task)
        answer = None
        for _ in range(args.max_turns):
            reply = await asyncio.to_thread(
                model.chat, messages, tools=tools, temperature=args.temperature,
                max_tokens=args.max_tokens)
            message = {"role": "assistant", "content": reply.get("content") or ""}
            calls = reply.get("tool_calls") or []
            if calls:
                message["tool_calls"] = calls
            messages.append(message)
            if not calls:
                answer = message["content"]
                break
            ended = False
            for call in calls:
                fn = call.get("function", {})
                try:
                    arguments = json.loads(fn.get("arguments") or "{}")
                except json.JSONDecodeError:
                    arguments = None
                if not isinstance(arguments, dict):
                    result_text, done, result_answer = \
                        "error: the arguments are not a JSON object", False, None
                else:
                    result = await env.call_tool(sandbox, task,
                                                 ToolCall(fn.get("name", ""), arguments))
                    result_text, done, result_answer = result.output, result.done, result.answer
                if _FAILED.match(result_text):
                    message["weight"] = 0  # a failed step: kept as context, not imitated
                messages.append({"role": "tool", "tool_call_id": call.get("id", ""),
                                 "content": result_text})
                if done:
                    answer, ended = result_answer, True
                    break
            if ended:
                break
        grade = await env.grade(sandbox, task, answer)
    mask_reverted(messages)
    return {"reward": grade.reward, "parts": grade.parts, "messages": messages, "tools": tools}
