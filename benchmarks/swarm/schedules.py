"""Whether the swarm example's orchestrator answers after a schedule it was never shown.

Its demonstrations are serial (assign, wait, four times over, now and then a second wait on
the same board, then the answer). A parallel schedule ends in the same results board, four
lines, but after fewer waits; RL can only pay for a parallel episode that then answers. This builds, for each held-out task's prompt in a
run of deploy/examples/swarm.yaml, the context every schedule of the four chains leads to
(groups of assignments between waits: 1+1+1+1 is serial, 4 is all at once), with the board's
right ends, and asks the checkpoint for the logit of `<answer>` minus that of `<call>` at the
next reply (its first token is one of the two), and for the probability of answering there at
the rollout's temperature. Printed: one line per schedule, means over the tasks.

Run: python benchmarks/swarm/schedules.py RUN_DIR [--checkpoint-stage sft] [--tasks 8]
Reads RUN_DIR/job.yaml and RUN_DIR/trainer/stages/<checkpoint stage>/ with transformers on
the CPU, and makes the held-out tasks from the job (tags tool-call format, as the example).
"""
from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

SCHEDULES = [(1, 1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2), (3, 1), (1, 3), (4,)]


def transcript(schedule: tuple[int, ...], ends: list[int], prefix: str) -> str:
    """The replies and observations of `schedule` up to the answer, as rollout writes them."""
    text, k = "", 0
    for group in schedule:
        for _ in range(group):
            k += 1
            text += f"{prefix}<call>assign next</call><obs>s{k}</obs>"
        board = "\n".join(f"s{i}: {e}" for i, e in enumerate(ends[:k], 1))
        text += f"{prefix}<call>wait all</call><obs>{board}</obs>"
    return text + prefix


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", type=Path, help="a run directory of deploy/examples/swarm.yaml")
    ap.add_argument("--checkpoint-stage", default="sft")
    ap.add_argument("--tasks", type=int, default=8, help="held-out tasks to build contexts from")
    args = ap.parse_args()
    from kiln.api.validate import load_job
    from kiln.services.sandbox.environments.wide import WideEnvironment

    spec = load_job(args.run_dir / "job.yaml", local=True).spec
    heldout = next(t for t in spec.tasks if t.env == "wide" and t.generate.split == "heldout")
    tasks = WideEnvironment().generate_tasks(heldout.generate)[: args.tasks]
    prefix = "<think></think>" if spec.rollout.thinking == "off" else ""
    temperature = spec.rollout.sampling.temperature or 1.0

    ckpt = args.run_dir / "trainer" / "stages" / args.checkpoint_stage
    tok = AutoTokenizer.from_pretrained(ckpt)
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    answer, call = tok.convert_tokens_to_ids("<answer>"), tok.convert_tokens_to_ids("<call>")
    print(f"{args.run_dir} ({args.checkpoint_stage}), {len(tasks)} held-out tasks, "
          f"P(answer) at temperature {temperature:g} between <answer> and <call>")
    with torch.no_grad():
        for schedule in SCHEDULES:
            gaps = []
            for task in tasks:
                text = task.description + transcript(schedule, task.ends, prefix)
                ids = tok.encode(text, add_special_tokens=False)
                logits = model(torch.tensor([ids])).logits[0, -1]
                gaps.append(float(logits[answer] - logits[call]))
            p = statistics.mean(float(torch.sigmoid(torch.tensor(g / temperature))) for g in gaps)
            print(f"  {'+'.join(map(str, schedule)):8s} answer - call logit {statistics.mean(gaps):7.2f}"
                  f"   P(answer) {p:.2e}")


if __name__ == "__main__":
    main()
