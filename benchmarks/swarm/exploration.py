"""How likely the swarm example's orchestrator is to try a parallel move before RL.

A parallel move is a second `assign` before any `wait`. RL can only reinforce one that is
sampled, so this reads the RL stage's episodes from a run of deploy/examples/swarm.yaml and, at
every turn that follows an `assign` call's observation (where a serial solver waits), asks the
orchestrator's SFT checkpoint for the probability that the turn's call is another `assign`:
- sampled like any token, at the rollout's temperature (over the whole vocabulary);
- sampled as a tool choice (`rollout.sampling.toolChoiceTemperature`, default: the job's): at
  that temperature among the tools' names alone, and then the probability that what it hands
  over is the next chain (`next` or its place, among `next` and the task's places, at the
  rollout's temperature), which a parallel move also needs.
Printed: the number of such decision points, the mean, median and largest probability, the
parallel moves to expect over the stage (the sum of the probabilities) and how many of the
stage's episodes did run two subagents at once.

Run: python benchmarks/swarm/exploration.py RUN_DIR [--checkpoint-stage sft]
     [--rl-stage swarm] [--temperature T] [--tool-choice-temperature TC]
Reads RUN_DIR/rollout/trajectories.jsonl and RUN_DIR/trainer/stages/<checkpoint stage>/ with
transformers on the CPU (tags tool-call format, as the example uses).
"""
from __future__ import annotations

import argparse
import functools
import json
import statistics
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def decision_points(tok, tokens: list[int], loss_mask: list[int]) -> list[int]:
    """Places of the `<call>` token opening each turn whose previous call was an `assign`."""
    call = tok.convert_tokens_to_ids("<call>")
    places = []
    for i in range(1, len(tokens)):
        if loss_mask[i] == 1 and loss_mask[i - 1] == 0 and tokens[i] == call:
            before = tok.decode(tokens[:i]).rsplit("<call>", 1)
            if len(before) == 2 and before[1].lstrip().startswith("assign"):
                places.append(i)
    return places


def report(what: str, probs: list[float]) -> None:
    print(f"{what}: mean {statistics.mean(probs):.2e}, median {statistics.median(probs):.2e}, "
          f"max {max(probs):.2e}; parallel moves to expect: {sum(probs):.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", type=Path, help="a run directory of deploy/examples/swarm.yaml")
    ap.add_argument("--checkpoint-stage", default="sft",
                    help="the stage whose final weights are the policy before RL")
    ap.add_argument("--rl-stage", default="swarm", help="the RL stage whose episodes are read")
    ap.add_argument("--temperature", type=float, default=None,
                    help="the orchestrator's sampling temperature (default: the run's "
                         "rollout.sampling.temperature)")
    ap.add_argument("--tool-choice-temperature", type=float, default=None,
                    help="the temperature of tool choices (default: the run's "
                         "rollout.sampling.toolChoiceTemperature, else the sampling temperature)")
    args = ap.parse_args()
    from kiln.api.validate import load_job
    sampling = load_job(args.run_dir / "job.yaml", local=True).spec.rollout.sampling
    if args.temperature is None:
        # Greedy (0) records raw log-probs, as 1 does.
        args.temperature = sampling.temperature or 1.0
    if args.tool_choice_temperature is None:
        args.tool_choice_temperature = sampling.tool_choice_temperature or args.temperature
    tc = args.tool_choice_temperature

    ckpt = args.run_dir / "trainer" / "stages" / args.checkpoint_stage
    tok = AutoTokenizer.from_pretrained(ckpt)
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    assign, wait = tok.convert_tokens_to_ids("assign"), tok.convert_tokens_to_ids("wait")
    space = tok.encode("assign 1", add_special_tokens=False)[1:-1]  # between name and place
    episodes = [r for r in map(json.loads, open(args.run_dir / "rollout" / "trajectories.jsonl"))
                if r["stage"] == args.rl_stage and "demonstration" not in r["flags"]]
    if not episodes:
        raise SystemExit(f"{args.run_dir}: no episodes of stage {args.rl_stage!r} yet")
    @functools.cache
    def first_tokens(width: int) -> list[int]:
        """The first token of each value an `assign` takes: `next`, then places 1..width."""
        return [tok.encode(f"assign {v}", add_special_tokens=False)[len(space) + 1]
                for v in ["next", *(str(k) for k in range(1, width + 1))]]

    probs, chosen, placed = [], [], []
    with torch.no_grad():
        for ep in episodes:
            assigned = 0
            for i in decision_points(tok, ep["tokens"], ep["loss_mask"]):
                context = ep["tokens"][: i + 1]
                logits = model(torch.tensor([context])).logits[0, -1]
                probs.append(float(torch.softmax(logits / args.temperature, -1)[assign]))
                choice = torch.softmax(logits[[assign, wait]] / tc, -1)[0]
                # What an explored `assign` hands over, among `next` and the task's places (at
                # the rollout's temperature): right when it is `next` or the next chain's place.
                text = tok.decode(context, skip_special_tokens=False)
                width = len(text.split("ends of ", 1)[1].split(",")[0].split())
                assigned = text.count("<call>assign")
                firsts = first_tokens(width)
                after = model(torch.tensor([context + [assign, *space]])).logits[0, -1]
                probs_v = torch.softmax(after[firsts] / args.temperature, -1)
                right = probs_v[0] + probs_v[min(assigned, width - 1) + 1]
                chosen.append(float(choice))
                placed.append(float(choice * right))
    parallel = sum(1 for ep in episodes if ep["reward_parts"].get("swarm/peak_parallel", 0) >= 2)
    print(f"episodes of {args.rl_stage}: {len(episodes)}, with 2+ subagents at once: {parallel}")
    if not probs:
        raise SystemExit("no turn follows an assign call in these episodes")
    print(f"decision points: {len(probs)}")
    report(f"P(another assign) at temperature {args.temperature:g}, any token", probs)
    report(f"P(another assign) as a tool choice at {tc:g}", chosen)
    report(f"P(another assign, of the next chain) as choices at {tc:g}", placed)


if __name__ == "__main__":
    main()
