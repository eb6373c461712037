"""Asynchronous vs synchronous RL on agentic-looking work, through the real `kiln run`.

    python benchmarks/async_rl/bench.py [--rl-steps 6] [--sft-steps 200] [--model DIR]
                                        [--work-dir DIR] [--num-steps 2] [--length-tail 1.0]
                                        [--tool-p50 1] [--tool-p99 30] [--tool-max 120]
                                        [--target-occupancy 32] [--max-episodes 512]

Three jobs cut down from deploy/examples/quickstart.yaml, each a `kiln run` subprocess with every
service a process and a fresh run directory under the work directory (a temporary one unless
--work-dir is given):
1. `bench-sft`: the quickstart's tiny model (created from `spec.model.init`) is fine-tuned for
   --sft-steps on the scripted solver, so that it follows the call/answer protocol and an episode
   lasts as many calls as its task asks (from random weights every episode would end at its
   first, malformed action, and all lengths would be equal). The last checkpoint is exported as
   a HF directory and shared by both RL jobs. --model DIR skips this and uses DIR.
2. `bench-sync` and `bench-async`: the same RL stage from the same model, identical except
   `rl.async`. Task lengths are long-tailed: each task's call count is drawn from a truncated
   Zipf law on [1, 4 * numSteps] (`generate.lengthTail`; 1..8 calls by default, mean ~2.9),
   and every tool call spends extra wall-clock time in its sandbox (`toolLatency`: a `sleep`
   drawn from a log-normal law, p50 1 s and p99 30 s by default, capped at 120 s), as tools that
   run tests or builds do. Rollout admits episodes by engine occupancy
   (`targetEngineOccupancy`), up to --max-episodes in flight.

Measured per RL job, from its run directory and live from the trainer's /metrics endpoint:
- RL wall time: the stage driver's elapsed time from ordering the stage to seeing it done;
- trajectories trained per minute: steps x batchSize / RL wall time (and the same from the end
  of the first step on, which leaves out start-up and the first batch's generation);
- trainer idle fraction: kiln_trainer_idle_seconds_total (time blocked waiting for a batch; the
  trainer process is fresh, so the counter covers this stage only) / RL wall time;
- rollout engine idle fraction: kiln_rollout_engine_idle_seconds_total over the stage (time the
  engine had no generate call in progress) / RL wall time;
- staleness: the buffer's kiln_trajectory_staleness histogram of the trajectories trained, and
  the episodes rollout stopped early because their group had fallen beyond tau;
- CPU time of the trainer and of the rollout process tree (vLLM's engine processes included)
  over the RL stage, and the 1-minute load average, since other work shares the cores.
Prints a side-by-side table, the ratio async/sync of trajectories trained per minute, the gain
that overlapping generation with training alone could give at sync's own speeds (1 / max(idle,
1 - idle) of the sync trainer; what async gains beyond it comes from rollout keeping its batch
full instead of waiting on each batch's longest episodes), and a JSON summary as the last line
(also written to WORK_DIR/results.json), after a line `async/sync: R.RRx (max staleness S, tau
T)`; the plot of the two runs is WORK_DIR/async_rl.png.

Not measured: learning (no evaluation runs; the RL jobs train on throughput alone), several
rollout replicas, a GPU, episodes longer than the chain task's 9 calls. The two RL jobs run
one after the other, so a change in machine load between them shows up in the ratio; the load
averages printed beside it say how much.

Starting and watching each `kiln run` (what is scraped from where, how often) is `runs.py`'s.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import yaml

from runs import RunTrace, export_model, run_kiln  # a sibling module: sys.path[0] is this folder

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "deploy" / "examples" / "quickstart.yaml"


# ----------------------------------------------------------------------------- jobs


def _job(base: dict, name: str, model: dict, tasks: dict, stage: dict, max_turns: int) -> dict:
    job = copy.deepcopy(base)
    job["metadata"]["name"] = name
    spec = job["spec"]
    spec["model"] = model
    spec["tasks"] = [{"name": "chain-train", "env": "chain", "generate": tasks}]
    spec["stages"] = [stage]
    # An episode of k calls takes k + 1 actions; ~22 tokens per call leaves the longest
    # (8 calls, ~175 tokens) inside the budget, so only the task decides an episode's length.
    spec["rollout"]["maxTurns"] = max_turns
    spec["rollout"]["sampling"]["maxTotalTokens"] = 240
    spec["trainer"]["checkpointInterval"] = 10_000  # only the final checkpoint on exit
    return job


def sft_job(base: dict, model_dir: Path, tasks: dict, steps: int, max_turns: int) -> dict:
    model = {**base["spec"]["model"], "path": str(model_dir)}
    sft = next(s for s in base["spec"]["stages"] if s["type"] == "sft")
    stage = {**sft, "maxSteps": steps, "warmupSteps": min(sft.get("warmupSteps", 0), steps // 5)}
    stage.pop("eval", None)
    return _job(base, "bench-sft", model, tasks, stage, max_turns)


def rl_job(base: dict, model_dir: Path, tasks: dict, steps: int, max_turns: int,
           asynchronous: bool, *, latency: dict, target: int, max_episodes: int,
           tau: int) -> dict:
    model = {"path": str(model_dir), "dtype": base["spec"]["model"].get("dtype", "float32")}
    rl = next(s for s in base["spec"]["stages"] if s["type"] == "rl")
    stage = {**rl, "maxSteps": steps, "rl": {**rl["rl"], "async": asynchronous, "tau": tau}}
    stage.pop("eval", None)
    name = "bench-async" if asynchronous else "bench-sync"
    job = _job(base, name, model, tasks, stage, max_turns)
    spec = job["spec"]
    spec["tasks"][0]["toolLatency"] = latency
    spec["rollout"]["maxConcurrentEpisodes"] = max_episodes
    spec["rollout"]["targetEngineOccupancy"] = target
    spec["rollout"]["episodeTimeoutSeconds"] = 900  # nine calls at the latency cap, and more
    # Each episode in flight holds a sandbox; every added sleep runs in it.
    spec["sandbox"]["maxConcurrent"] = max_episodes
    spec["sandbox"]["timeoutSeconds"] = latency["maxSeconds"] + 30
    return job


# ----------------------------------------------------------------------------- measuring


def _nearest(samples: list[tuple[float, object]], t: float):
    return min(samples, key=lambda s: abs(s[0] - t)) if samples else None


def measure(trace: RunTrace, batch_size: int) -> dict:
    recs = [json.loads(line) for line in (trace.run_dir / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in recs if r.get("event") == "progress" and r["stage"].startswith("rl")]
    if not rl:
        raise RuntimeError(f"{trace.run_dir}: no RL progress in metrics.jsonl")
    done = next((r for r in rl if r["trainer"].get("stage_done")), rl[-1])
    t_start, t_end = done["time"] - done["elapsed"], done["time"]
    wall, steps = done["elapsed"], done["step"]
    first = next((r for r in rl if r["step"] >= 1), done)
    steady = ((steps - first["step"]) * batch_size / (t_end - first["time"]) * 60
              if t_end > first["time"] else float("nan"))
    step_times = {r["step"]: r["trainer"]["step_seconds"] for r in rl
                  if r["step"] >= 1 and r["trainer"].get("step_seconds") is not None}
    if not trace.idle or trace.idle[-1][0] < t_end:
        raise RuntimeError(f"{trace.run_dir}: the trainer's idle counter was not read after the stage ended")
    idle = trace.idle[-1][1]
    e0, e1 = _nearest(trace.engine_idle, t_start), _nearest(trace.engine_idle, t_end)
    engine_idle = (e1[1] - e0[1]) / (e1[0] - e0[0]) if e0 and e1 and e1[0] > e0[0] else float("nan")
    # Cumulative buckets -> trajectories trained per staleness value (bounds 0, 1, 2, ...).
    cum = sorted(((float(le), n) for le, n in trace.staleness.items() if le != "+Inf"))
    staleness, below = {}, 0.0
    for le, n in cum:
        if n > below:
            staleness[str(int(le))] = int(n - below)
        below = n
    cpu = {}
    a, b = _nearest(trace.cpu, t_start), _nearest(trace.cpu, t_end)
    if a and b and b[0] > a[0]:
        cpu = {s: (b[1][s] - a[1][s]) / (b[0] - a[0]) for s in b[1] if s in a[1]}
    loads = [v for t, v in trace.load if t_start <= t <= t_end]
    # Rollout keeps every 10th trajectory: their lengths show the tail the policy produced.
    lengths = sorted(len(json.loads(line)["tokens"]) for line in
                     (trace.run_dir / "rollout" / "trajectories.jsonl").read_text().splitlines())
    return {
        "rl_wall_seconds": wall,
        "steps": steps,
        "trajectories_trained": steps * batch_size,
        "trajectories_per_minute": steps * batch_size / wall * 60,
        "steady_trajectories_per_minute": steady,
        "trainer_idle_seconds": idle,
        "trainer_idle_fraction": idle / wall,
        "engine_idle_fraction": engine_idle,
        "staleness_trained": staleness,
        "stopped_stale": done["rollout"].get("stopped_stale", 0),
        "mean_step_seconds": sum(step_times.values()) / len(step_times) if step_times else float("nan"),
        "episodes_generated": done["rollout"]["episodes"],
        "dropped_stale": done["buffer"]["dropped_stale"],
        "max_staleness": done["buffer"]["max_staleness"],
        "trainer_cpu_cores": cpu.get("trainer", float("nan")),
        "rollout_cpu_cores": cpu.get("rollout", float("nan")),
        "tokens_p50": lengths[len(lengths) // 2],
        "tokens_p90": lengths[len(lengths) * 9 // 10],
        "tokens_max": lengths[-1],
        "load_1min_mean": sum(loads) / len(loads) if loads else float("nan"),
        "load_1min_max": max(loads, default=float("nan")),
        "run_seconds": trace.seconds,
    }


ROWS = [
    ("RL wall time (s)", "rl_wall_seconds", "{:.1f}"),
    ("optimizer steps", "steps", "{:d}"),
    ("trajectories trained", "trajectories_trained", "{:d}"),
    ("trajectories trained / min", "trajectories_per_minute", "{:.1f}"),
    ("  after the first step", "steady_trajectories_per_minute", "{:.1f}"),
    ("trainer idle (s)", "trainer_idle_seconds", "{:.1f}"),
    ("trainer idle fraction", "trainer_idle_fraction", "{:.2f}"),
    ("rollout engine idle fraction", "engine_idle_fraction", "{:.2f}"),
    ("mean trainer step (s)", "mean_step_seconds", "{:.2f}"),
    ("episodes generated", "episodes_generated", "{:d}"),
    ("trajectory tokens p50 (sampled)", "tokens_p50", "{:d}"),
    ("trajectory tokens p90 (sampled)", "tokens_p90", "{:d}"),
    ("trajectory tokens max (sampled)", "tokens_max", "{:d}"),
    ("episodes stopped beyond tau", "stopped_stale", "{:d}"),
    ("dropped stale (buffer)", "dropped_stale", "{:d}"),
    ("max staleness served", "max_staleness", "{:d}"),
    ("trainer CPU (cores)", "trainer_cpu_cores", "{:.2f}"),
    ("rollout CPU (cores, with vLLM)", "rollout_cpu_cores", "{:.2f}"),
    ("load average 1-min, mean", "load_1min_mean", "{:.1f}"),
    ("load average 1-min, max", "load_1min_max", "{:.1f}"),
]


def table(sync: dict, asyn: dict) -> str:
    lines = [f"{'':32} {'sync':>10} {'async':>10}"]
    for label, key, fmt in ROWS:
        lines.append(f"{label:32} {fmt.format(sync[key]):>10} {fmt.format(asyn[key]):>10}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rl-steps", type=int, default=6, help="optimizer steps of each RL job")
    p.add_argument("--sft-steps", type=int, default=200, help="SFT steps of the shared model")
    p.add_argument("--model", type=Path, help="use this HF model directory instead of running SFT")
    p.add_argument("--work-dir", type=Path, help="default: a new temporary directory")
    p.add_argument("--num-steps", type=int, default=2, help="generate.numSteps (calls: 1..4x this)")
    p.add_argument("--length-tail", type=float, default=1.0, help="generate.lengthTail (Zipf exponent)")
    p.add_argument("--tool-p50", type=float, default=1.0, help="median seconds added per tool call")
    p.add_argument("--tool-p99", type=float, default=30.0, help="99th percentile of it")
    p.add_argument("--tool-max", type=float, default=120.0, help="cap of it")
    p.add_argument("--target-occupancy", type=int, default=32, help="rollout.targetEngineOccupancy")
    p.add_argument("--max-episodes", type=int, default=512, help="rollout.maxConcurrentEpisodes")
    p.add_argument("--tau", type=int, default=4, help="rl.tau of both RL jobs")
    p.add_argument("--timeout", type=float, default=900, help="seconds allowed per kiln run")
    args = p.parse_args(argv)
    out = sys.stdout

    work = (args.work_dir or Path(tempfile.mkdtemp(prefix="kiln-async-bench-"))).resolve()
    work.mkdir(parents=True, exist_ok=True)
    base = yaml.safe_load(QUICKSTART.read_text())
    tasks = {"count": 20000, "seed": 1, "numSteps": args.num_steps, "lengthTail": args.length_tail}
    max_turns = 4 * args.num_steps + 2
    started = time.monotonic()
    out.write(f"work directory: {work}\nload average at start: {os.getloadavg()[0]:.1f}\n")

    if args.model is not None:
        model = args.model.resolve()
        how = f"given model {model}"
    else:
        init_dir, model = work / "model-init", work / "model-sft"
        run_kiln(sft_job(base, init_dir, tasks, args.sft_steps, max_turns), work, args.timeout, out)
        export_model(init_dir, work / "bench-sft", model)
        how = f"quickstart model after {args.sft_steps} SFT steps"
    if not (model / "config.json").exists():
        p.error(f"--model: {model} holds no config.json")

    results = {}
    latency = {"p50Seconds": args.tool_p50, "p99Seconds": args.tool_p99,
               "maxSeconds": args.tool_max, "seed": 7}
    for asynchronous in (False, True):
        job = rl_job(base, model, tasks, args.rl_steps, max_turns, asynchronous, latency=latency,
                     target=args.target_occupancy, max_episodes=args.max_episodes, tau=args.tau)
        batch = job["spec"]["stages"][0]["batchSize"]
        trace = run_kiln(job, work, args.timeout, out)
        results["async" if asynchronous else "sync"] = measure(trace, batch)

    sync, asyn = results["sync"], results["async"]
    ratio = asyn["trajectories_per_minute"] / sync["trajectories_per_minute"]
    steady_ratio = asyn["steady_trajectories_per_minute"] / sync["steady_trajectories_per_minute"]
    # Overlap alone can at best turn a sync cycle (generate, then train) into the longer of
    # the two: at sync's own speeds, a gain of 1 / max(idle, busy). More than that means
    # rollout itself got faster (no waiting on each batch's longest episodes).
    idle = sync["trainer_idle_fraction"]
    ceiling = 1 / max(idle, 1 - idle)
    stage = job["spec"]["stages"][0]
    out.write(f"\nmodel: {how}; tasks: 1..{4 * args.num_steps} calls, Zipf exponent "
              f"{args.length_tail}; tool latency log-normal p50 {args.tool_p50:g} s, p99 "
              f"{args.tool_p99:g} s, cap {args.tool_max:g} s; RL: {args.rl_steps} steps of "
              f"{stage['batchSize']} trajectories (groupSize {stage['rl']['groupSize']}, tau "
              f"{stage['rl']['tau']}); rollout: target occupancy {args.target_occupancy}, at most "
              f"{args.max_episodes} episodes\n\n")
    out.write(table(sync, asyn) + "\n")
    for name, r in (("sync", sync), ("async", asyn)):
        out.write(f"staleness of trained trajectories, {name}: {r['staleness_trained']}\n")
    out.write(f"\nasync / sync, trajectories trained per minute: {ratio:.2f}x; "
              f"after the first step: {steady_ratio:.2f}x\n")
    out.write(f"gain from overlap alone at sync's speeds, 1 / max(idle, 1 - idle) of sync: "
              f"{ceiling:.2f}x\n")
    out.write(f"benchmark wall time: {time.monotonic() - started:.0f} s\n")
    summary = {"model": how, "num_steps": args.num_steps, "length_tail": args.length_tail,
               "rl_steps": args.rl_steps, "sync": sync, "async": asyn, "ratio": ratio,
               "steady_ratio": steady_ratio, "overlap_ceiling": ceiling, "tau": args.tau,
               "tool_latency": latency, "target_occupancy": args.target_occupancy,
               "max_episodes": args.max_episodes}
    (work / "results.json").write_text(json.dumps(summary, indent=2))
    plot(sync, asyn, work / "async_rl.png")
    out.write(json.dumps(summary) + "\n")
    out.write(f"async/sync: {ratio:.2f}x (max staleness {max(asyn['max_staleness'], 0)}, "
              f"tau {args.tau})\n")
    return 0


def plot(sync: dict, asyn: dict, path: Path) -> None:
    """Throughput, idle fractions and the staleness of what was trained, sync beside async."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b, c) = plt.subplots(1, 3, figsize=(13, 3.8))
    a.bar(["sync", "async"], [sync["trajectories_per_minute"], asyn["trajectories_per_minute"]],
          color=["tab:gray", "tab:blue"])
    a.set_title("trajectories trained / min")
    keys = [("trainer_idle_fraction", "trainer"), ("engine_idle_fraction", "rollout engine")]
    x = range(len(keys))
    b.bar([i - 0.2 for i in x], [sync[k] for k, _ in keys], 0.4, label="sync", color="tab:gray")
    b.bar([i + 0.2 for i in x], [asyn[k] for k, _ in keys], 0.4, label="async", color="tab:blue")
    b.set_xticks(list(x), [n for _, n in keys])
    b.set_ylim(0, 1)
    b.set_title("idle fraction")
    b.legend()
    values = sorted({int(v) for r in (sync, asyn) for v in r["staleness_trained"]})
    for off, name, r, color in ((-0.2, "sync", sync, "tab:gray"), (0.2, "async", asyn, "tab:blue")):
        total = sum(r["staleness_trained"].values()) or 1
        c.bar([v + off for v in values], [r["staleness_trained"].get(str(v), 0) / total
                                           for v in values], 0.4, label=name, color=color)
    c.set_xlabel("staleness (versions)")
    c.set_title("share of trained trajectories")
    c.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
