"""`kiln simulate`: what an RL stage's throughput, staleness and idle time would be, synchronous
beside asynchronous, from the job's own settings and a model of its hardware and workload
(the discrete-event simulator in `simulator.py`).

Two uses:
- a job as written: `kiln simulate job.yaml --step-base 0.02 --step-per-seq 0.0005
  --train-step 1.4` simulates its RL stage (its batch, group, tau, rollout admission, task
  lengths and `toolLatency`) in both modes and prints them side by side;
- a large job to plan: `--accelerators 1024 --replica-accelerators 2 --train-seconds-per-
  trajectory 0.7` searches the split of the accelerators between rollout and training and
  tau (`--taus`), and prints the configuration with the most trajectories trained per minute
  within `--max-staleness`.

Episode lengths come from the task set's generator (the chain task's Zipf law) or from
`--calls-p50/--calls-p99` (a log-normal law); what the job cannot say (tokens per turn, engine
speed, training and weight-sync time) comes from the options, whose defaults describe the
quickstart's tiny model on two CPU cores.

Large jobs are simulated on `--sim-replicas` replicas with the batch scaled down by the same
factor (each replica then sees the load it would see in the whole job, and the trainer the
same step time); throughput is scaled back up. This mean-field shortcut ignores the spread
between replicas, which only a full-size run would show.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import random
import statistics
import sys

from kiln.cli.conventions import add_job, add_set
from kiln.cli.exits import Exit
from kiln.cli.simulation import (EngineModel, JobModel, Result, Workload, nominal_episode_seconds,
                                 zipf_calls)
from kiln.cli.simulator import simulate
from kiln.services.sandbox.latency import log_normal


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("simulate", help="simulate an RL stage's throughput and staleness",
                       description=__doc__.split("\n\n")[0])
    add_job(p, "RLJob manifest")
    add_set(p)
    p.add_argument("--stage", help="the RL stage to simulate (default: the first)")
    p.add_argument("--steps", type=int, help="optimizer steps (default: the stage's maxSteps)")
    p.add_argument("--seeds", type=int, default=3, help="runs averaged per configuration")
    w = p.add_argument_group("workload")
    w.add_argument("--calls-p50", type=float, help="median tool calls per episode (log-normal)")
    w.add_argument("--calls-p99", type=float, help="99th percentile of them")
    w.add_argument("--calls-max", type=int, default=1000, help="most tool calls per episode")
    w.add_argument("--gen-tokens", type=int, default=22, help="tokens sampled per turn")
    w.add_argument("--prompt-tokens", type=int, default=24, help="tokens of the task prompt")
    w.add_argument("--obs-tokens", type=int, default=10, help="tokens each tool output adds")
    h = p.add_argument_group("hardware")
    h.add_argument("--step-base", type=float, default=0.012,
                   help="seconds of one decode step of a replica, before sequences")
    h.add_argument("--step-per-seq", type=float, default=0.0006,
                   help="seconds each decoding sequence adds to a step")
    h.add_argument("--prefill-cost", type=float, default=0.05,
                   help="decode steps of work per prefilled context token")
    h.add_argument("--max-seqs", type=int, default=256, help="sequences a replica decodes at once")
    h.add_argument("--train-step", type=float, default=1.4, help="seconds of one optimizer step")
    h.add_argument("--sync-pause", type=float, default=0.5,
                   help="seconds a replica stops to load a new version")
    h.add_argument("--replicas", type=int, help="rollout replicas (default: the job's)")
    s = p.add_argument_group("planning a large job")
    s.add_argument("--accelerators", type=int, help="accelerators to split (enables the search)")
    s.add_argument("--replica-accelerators", type=int, default=1,
                   help="accelerators of one rollout replica")
    s.add_argument("--train-seconds-per-trajectory", type=float,
                   help="accelerator-seconds of training per trajectory")
    s.add_argument("--taus", default="1,2,4,8", help="tau values to try")
    s.add_argument("--shares", default="0.25,0.375,0.5,0.625,0.75,0.875",
                   help="shares of the accelerators given to rollout, to try")
    s.add_argument("--occupancies", help="targetEngineOccupancy values to try (default: the job's)")
    s.add_argument("--max-staleness", type=int, default=8, help="bound on the staleness trained")
    s.add_argument("--sim-replicas", type=int, default=16, help="replicas actually simulated")
    p.set_defaults(func=run)


# ----------------------------------------------------------------------------- the job


def _stage(job, name: str | None):
    from kiln.api.spec import RLStage
    stages = [s for s in job.spec.stages if isinstance(s, RLStage)]
    if not stages:
        raise SystemExit(f"{job.metadata.name}: spec.stages has no RL stage to simulate")
    if name is None:
        return stages[0]
    for s in stages:
        if s.name == name:
            return s
    raise SystemExit(f"--stage: no RL stage {name!r} (RL stages: {[s.name for s in stages]})")


def workload(job, stage, args) -> Workload:
    if not stage.tasks:
        raise SystemExit(f"stage {stage.name}: it trains on outside episodes alone (tasks is "
                         "empty), whose tool calls and latencies are not known here")
    task_set = next(t for t in job.spec.tasks if t.name == stage.tasks[0])
    if args.calls_p50 is not None:
        law = log_normal(args.calls_p50, args.calls_p99 or args.calls_p50)

        def calls(rng: random.Random) -> int:
            return max(1, min(args.calls_max, round(math.exp(rng.gauss(*law)))))
    elif task_set.generate is not None:
        gen = task_set.generate
        calls = (zipf_calls(gen.num_steps, gen.length_tail) if gen.length_tail is not None
                 else (lambda rng, k=gen.num_steps: k))
    else:
        raise SystemExit(f"task set {task_set.name!r} is read from a file: give --calls-p50 and "
                         "--calls-p99 for its episode lengths")
    lat = task_set.tool_latency
    return Workload(calls, args.gen_tokens, args.prompt_tokens, args.obs_tokens,
                    lat.p50_seconds if lat else 0.0, lat.p99_seconds if lat else 0.0,
                    lat.max_seconds if lat else math.inf)


def job_model(job, stage, args, asynchronous: bool) -> JobModel:
    r = job.spec.rollout
    return JobModel(
        batch=stage.batch_size, group=stage.rl.group_size, tau=stage.rl.tau,
        asynchronous=asynchronous, train_step=args.train_step, sync_pause=args.sync_pause,
        replicas=args.replicas or max(1, r.replicas), max_concurrent=r.max_concurrent_episodes,
        target_occupancy=r.target_engine_occupancy, sync_interval=stage.rl.sync_interval,
        steps=args.steps or stage.max_steps)


def averaged(w: Workload, e: EngineModel, j: JobModel, seeds: int, scale: float = 1.0) -> dict:
    runs: list[Result] = [simulate(w, e, j, seed) for seed in range(seeds)]
    return {
        "trajectories_per_minute": statistics.mean(r.trajectories_per_minute for r in runs) * scale,
        "steady_per_minute": statistics.mean(r.steady_per_minute(j.batch) for r in runs) * scale,
        "seconds": statistics.mean(r.seconds for r in runs),
        "trainer_idle": statistics.mean(r.trainer_idle for r in runs),
        "engine_idle": statistics.mean(r.engine_idle for r in runs),
        "max_staleness": max(r.max_staleness for r in runs),
        "mean_staleness": statistics.mean(
            sum(k * n for k, n in r.staleness.items()) / max(1, sum(r.staleness.values()))
            for r in runs),
        "stopped_stale": statistics.mean(r.stopped_stale for r in runs),
        "episode_p50": statistics.mean(_quantile(r.episode_seconds, 0.5) for r in runs),
        "episode_p99": statistics.mean(_quantile(r.episode_seconds, 0.99) for r in runs),
        "dropped_stale": statistics.mean(r.dropped_stale for r in runs),
    }


def _quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else 0.0


ROWS = [("trajectories trained / min", "trajectories_per_minute", "{:.1f}"),
        ("  from the first quarter on", "steady_per_minute", "{:.1f}"),
        ("stage seconds", "seconds", "{:.1f}"),
        ("trainer idle fraction", "trainer_idle", "{:.2f}"),
        ("engine idle fraction", "engine_idle", "{:.2f}"),
        ("max staleness trained", "max_staleness", "{:d}"),
        ("mean staleness trained", "mean_staleness", "{:.2f}"),
        ("episodes stopped beyond tau", "stopped_stale", "{:.0f}"),
        ("dropped stale (buffer)", "dropped_stale", "{:.0f}"),
        ("episode seconds p50", "episode_p50", "{:.1f}"),
        ("episode seconds p99", "episode_p99", "{:.1f}")]


# ----------------------------------------------------------------------------- the search


def search(w: Workload, e: EngineModel, job, stage, args, out) -> dict | None:
    if not args.train_seconds_per_trajectory:
        raise SystemExit("--accelerators needs --train-seconds-per-trajectory")
    base = job_model(job, stage, args, asynchronous=True)
    taus = [int(t) for t in args.taus.split(",")]
    occupancies = ([int(o) for o in args.occupancies.split(",")] if args.occupancies
                   else [base.target_occupancy])
    g, n = args.replica_accelerators, args.accelerators
    best = None
    out.write(f"{'rollout':>8} {'train':>6} {'tau':>4} {'occupancy':>9} {'traj/min':>10} {'max stale':>10} "
              f"{'trainer idle':>13} {'engine idle':>12} {'stopped':>8}\n")
    configs = [(float(share), tau, occ) for share in args.shares.split(",") for tau in taus
               for occ in occupancies]
    for share, tau, occupancy in configs:
        replicas = max(1, int(n * share) // g)
        train = n - replicas * g
        if train <= 0:
            continue
        step = stage.batch_size * args.train_seconds_per_trajectory / train
        sim = min(replicas, args.sim_replicas)
        groups = max(1, round(stage.batch_size * sim / replicas / stage.rl.group_size))
        j = dataclasses.replace(base, batch=groups * stage.rl.group_size, tau=tau,
                                train_step=step, replicas=sim, target_occupancy=occupancy)
        r = averaged(w, e, j, args.seeds, scale=replicas / sim)
        out.write(f"{replicas * g:>8} {train:>6} {tau:>4} {occupancy or 0:>9} "
                  f"{r['steady_per_minute']:>10.0f} {r['max_staleness']:>10d} "
                  f"{r['trainer_idle']:>13.2f} {r['engine_idle']:>12.2f} "
                  f"{r['stopped_stale'] * replicas / sim:>8.0f}\n")
        out.flush()
        if r["max_staleness"] <= args.max_staleness and (
                best is None or r["steady_per_minute"] > best["steady_per_minute"]):
            best = {**r, "rollout_accelerators": replicas * g, "train_accelerators": train,
                    "replicas": replicas, "tau": tau, "train_step": step, "occupancy": occupancy}
    return best


def run(args: argparse.Namespace) -> int:
    from kiln.api.validate import ManifestError, load_job
    try:
        job = load_job(args.job, overrides=args.overrides)
    except ManifestError as exc:
        print(exc, file=sys.stderr)
        return Exit.REFUSED
    stage = _stage(job, args.stage)
    w = workload(job, stage, args)
    e = EngineModel(args.step_base, args.step_per_seq, args.prefill_cost, args.max_seqs)
    out = sys.stdout
    occupancy = job.spec.rollout.target_engine_occupancy or job.spec.rollout.max_concurrent_episodes
    p50, p99 = nominal_episode_seconds(w, e, min(occupancy, args.max_seqs))
    out.write(f"episodes as the workload defines them (at {min(occupancy, args.max_seqs)} sequences "
              f"per engine, no waiting, no stop): p50 {p50:.1f} s, p99 {p99:.1f} s "
              f"({p99 / p50:.0f}x)\n")
    if args.accelerators:
        best = search(w, e, job, stage, args, out)
        if best is None:
            out.write(f"no configuration kept staleness within {args.max_staleness}\n")
            return Exit.PROBLEMS_FOUND
        out.write(f"\nbest within max staleness {args.max_staleness}: {best['rollout_accelerators']} "
                  f"accelerators on rollout ({best['replicas']} replicas), "
                  f"{best['train_accelerators']} on training (step {best['train_step']:.1f} s), "
                  f"tau {best['tau']}, target occupancy {best['occupancy']}: "
                  f"{best['steady_per_minute']:.0f} trajectories/min, "
                  f"max staleness {best['max_staleness']}, trainer idle {best['trainer_idle']:.2f}, "
                  f"engine idle {best['engine_idle']:.2f}; episodes p50 {best['episode_p50']:.0f} s, "
                  f"p99 {best['episode_p99']:.0f} s\n")
        return Exit.OK
    results = {mode: averaged(w, e, job_model(job, stage, args, mode == "async"), args.seeds)
               for mode in ("sync", "async")}
    out.write(f"{job.metadata.name} / {stage.name}: simulated, mean of {args.seeds} seeds\n")
    out.write(f"{'':30} {'sync':>10} {'async':>10}\n")
    for label, key, fmt in ROWS:
        out.write(f"{label:30} {fmt.format(results['sync'][key]):>10} "
                  f"{fmt.format(results['async'][key]):>10}\n")
    ratio = results["async"]["trajectories_per_minute"] / results["sync"]["trajectories_per_minute"]
    out.write(f"async/sync: {ratio:.2f}x (max staleness {results['async']['max_staleness']}, "
              f"tau {stage.rl.tau})\n")
    return Exit.OK
