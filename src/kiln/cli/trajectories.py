"""`kiln trajectories RUN_DIR`: print sampled trajectories of a run, human-readably.

Shows each turn (prompt, actions, observations) decoded with the run's tokenizer, the policy
version spans, the reward and its parts, and the verifier's output. Reads the samples rollout
keeps in `RUN_DIR/rollout/trajectories.jsonl`, or with `--evaluations` every held-out
evaluation episode (`RUN_DIR/rollout/evaluations.jsonl`; stage `eval/<task set>`, greedy ones
at temperature 0).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "trajectories", help="print trajectories of a run human-readably",
        description="Print sampled trajectories of a run (every tenth one rollout finished): "
                    "each turn decoded with the run's tokenizer, the policy-version spans, the "
                    "reward and its parts, and the verifier's output.")
    p.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="run directory of `kiln run`")
    p.add_argument("-n", "--limit", type=int, default=5, help="how many (default 5; 0 = all)")
    p.add_argument("--stage", help="only trajectories of this stage")
    p.add_argument("--reward", type=float, help="only trajectories with this reward")
    p.add_argument("--last", action="store_true", help="the most recent ones instead of the first")
    p.add_argument("--evaluations", action="store_true",
                   help="evaluation episodes (every one) instead of training samples")
    p.add_argument("--greedy", action="store_true", help="with --evaluations: only greedy ones")
    p.set_defaults(func=main)


def _segments(t: dict) -> list[tuple[str, list[int]]]:
    """Split the token sequence into runs of equal loss mask: ('prompt'|'action'|'observation', ids)."""
    out: list[tuple[str, list[int]]] = []
    for i, (tok, m) in enumerate(zip(t["tokens"], t["loss_mask"])):
        kind = "prompt" if i < t["prompt_len"] else ("action" if m else "observation")
        if out and out[-1][0] == kind:
            out[-1][1].append(tok)
        else:
            out.append((kind, [tok]))
    return out


def main(args: argparse.Namespace) -> int:
    if args.greedy and not args.evaluations:
        print("kiln trajectories: --greedy selects evaluation episodes; add --evaluations "
              "(training samples are all sampled)", file=sys.stderr)
        return 2
    name = "evaluations.jsonl" if args.evaluations else "trajectories.jsonl"
    path = args.run_dir / "rollout" / name
    if not path.exists():
        print(f"kiln trajectories: {path} does not exist (is {args.run_dir} a run directory?)", file=sys.stderr)
        return 2
    from transformers import AutoTokenizer

    job = yaml.safe_load((args.run_dir / "job.yaml").read_text())
    model = job["spec"]["model"]
    tok = AutoTokenizer.from_pretrained(model.get("tokenizer") or model["path"])
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if args.stage:
        rows = [r for r in rows if r["stage"] == args.stage]
    if args.greedy:
        rows = [r for r in rows if r.get("temperature") == 0]
    if args.reward is not None:
        rows = [r for r in rows if r["reward"] == args.reward]
    if args.last:
        rows = rows[::-1]
    if args.limit:
        rows = rows[: args.limit]
    for t in rows:
        spans = ", ".join(f"[{s['start']},{s['end']})@v{s['policy_version']}" for s in t["version_spans"])
        parts = ", ".join(f"{k}={v:g}" for k, v in t["reward_parts"].items())
        sampled = f"  temperature {t['temperature']:g} at v{t['version']}" if "temperature" in t else ""
        print(f"=== {t['id'][:12]}  stage {t['stage']}  task {t['task_id']}  group {t['group_id'][:8]}{sampled}")
        print(f"    reward {t['reward']:g} ({parts})  verifier: {t['verifier_output']}  flags: {t['flags']}")
        print(f"    {len(t['tokens'])} tokens, {sum(t['loss_mask'])} trained; versions {spans}")
        for kind, ids in _segments(t):
            print(f"    {kind:>11}: {tok.decode(ids, skip_special_tokens=False)}")
    if not rows:
        print("no trajectories match", file=sys.stderr)
    return 0
