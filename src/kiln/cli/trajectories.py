"""`kiln trajectories RUN_DIR`: print sampled trajectories of a run, human-readably.

Shows each turn (prompt, actions, observations) decoded with the run's tokenizer, the policy
version spans, the reward and its parts, and the verifier's output. Reads the samples rollout
keeps in `RUN_DIR/rollout/trajectories.jsonl`, or with `--evaluations` every held-out
evaluation episode (`RUN_DIR/rollout/evaluations.jsonl`; stage `eval/<task set>`, greedy ones
at temperature 0).

RUN_DIR may also be a cluster job's output (`spec.output`), a folder or an `s3://bucket/prefix`
location (credentials and `AWS_ENDPOINT_URL_S3` from the environment), as `kiln export` reads
it: its `trajectories.jsonl` is the trainer's sample of what it trained on, written at the end
of each stage, and the tokenizer is the one exported beside it (`final-hf/`). Evaluation
episodes stay in the rollout pods; an output has none.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import yaml

from kiln.cli.exits import Exit

SAMPLE_LOG = "trajectories.jsonl"
"""The trainer's sample log in a job's output (`kiln.services.trainer.output`)."""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "trajectories", help="print trajectories of a run human-readably",
        description="Print sampled trajectories of a run (every tenth one rollout finished): "
                    "each turn decoded with the run's tokenizer, the policy-version spans, the "
                    "reward and its parts, and the verifier's output.")
    p.add_argument("run_dir", metavar="RUN_DIR",
                   help="run directory of `kiln run`, or a cluster job's output (a folder or "
                        "s3://bucket/prefix)")
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
        return Exit.REFUSED
    with tempfile.TemporaryDirectory() as tmp:
        try:
            path, tokenizer = _located(args.run_dir, args.evaluations, Path(tmp))
        except ValueError as exc:
            print(f"kiln trajectories: {exc}", file=sys.stderr)
            return Exit.REFUSED
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tokenizer)
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return _show(rows, tok, args)


def _located(where: str, evaluations: bool, tmp: Path) -> tuple[Path, str]:
    """(the JSON lines file, the tokenizer's folder) of a run directory or a job's output (an
    s3:// one's copied into `tmp`); ValueError saying what is missing."""
    from kiln.cli.export import is_output_dir

    remote = "://" in where
    if remote or is_output_dir(Path(where)):
        if evaluations:
            raise ValueError(f"--evaluations: {where} is a job's output, which holds the "
                             "trainer's sample of training trajectories only (evaluation "
                             "episodes stay in the rollout pods)")
        return _fetched(where.rstrip("/"), tmp) if remote else _in_output(Path(where))
    run_dir = Path(where)
    path = run_dir / "rollout" / ("evaluations.jsonl" if evaluations else "trajectories.jsonl")
    if not path.exists():
        raise ValueError(f"{path} does not exist (is {where} a run directory, or a job's output?)")
    model = yaml.safe_load((run_dir / "job.yaml").read_text())["spec"]["model"]
    return path, model.get("tokenizer") or model["path"]


def _in_output(output: Path) -> tuple[Path, str]:
    path = output / SAMPLE_LOG
    if not path.exists():
        raise ValueError(f"{path} does not exist: no stage has ended since the trainer began "
                         "writing trajectories to the output")
    return path, str(output / "final-hf")


def _fetched(uri: str, tmp: Path) -> tuple[Path, str]:
    """The output's trajectories and its exported tokenizer (not the weights), copied."""
    import fsspec

    fs, root = fsspec.core.url_to_fs(uri)
    if not fs.exists(f"{root}/{SAMPLE_LOG}"):
        raise ValueError(f"{uri}: no {SAMPLE_LOG} there: no stage has ended since the trainer "
                         "began writing trajectories to the output")
    fs.get_file(f"{root}/{SAMPLE_LOG}", str(tmp / SAMPLE_LOG))
    for key in fs.find(f"{root}/final-hf"):
        if not key.endswith((".safetensors", ".bin", ".pt")):
            target = tmp / "tokenizer" / key.removeprefix(f"{root}/final-hf/")
            target.parent.mkdir(parents=True, exist_ok=True)
            fs.get_file(key, str(target))
    return tmp / SAMPLE_LOG, str(tmp / "tokenizer")


def _show(rows: list[dict], tok, args: argparse.Namespace) -> int:
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
