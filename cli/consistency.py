"""`kiln consistency --model DIR | --dsa`: do rollout and training (Megatron) agree on log-probs?

IcePop and the off-policy ratio assume that the inference engine and the trainer compute the same
distribution for the same weights. This command checks it end to end, through the real paths:

1. start the rollout engine and the Megatron trainer engine on the same checkpoint;
2. version 0: sample sequences with the rollout engine (recording its per-token log-probs), score
   the same tokens with the trainer, compare;
3. take one supervised training step on those sequences, publish the new weights through a
   weight-sync service on loopback gRPC, and let the engine apply them as a subscribed replica;
4. version 1: sample again, score again, compare.

The rollout engine (`--engine`) is vLLM for ordinary checkpoints and `megatron` (the trainer's
own model code, `kiln.services.rollout.megatron_engine`) for DeepSeek-sparse-attention ones
(config.json `kiln_dsa`), which vLLM cannot run. `--dsa` makes a tiny random DSA checkpoint to
check. For a DSA model in float32 the two must agree bit for bit (default threshold 0), and the
per-layer hashes of the selected top-k indices must match too.

It prints, per version, the max and mean |log-prob difference| over the sampled tokens and OK or
MISMATCH against `--threshold` (default 1e-4 in float32, 3e-2 in bfloat16, 0 for a DSA model
in float32), then for DSA models the index-hash matches, and exits 1 on any
MISMATCH. Not covered: tensor parallelism (the trainer runs TP=1 here) and sequences longer than
`--max-tokens` plus the prompt.
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
from pathlib import Path

DEFAULT_THRESHOLDS = {"float32": 1e-4, "bfloat16": 3e-2}
EXACT_THRESHOLDS = {"float32": 0.0, "bfloat16": 3e-2}
"""The megatron engine on a DSA model runs the trainer's code with length-independent row
arithmetic (see `dsa.ROW_MULTIPLE`): float32 must match bit for bit. Dense models keep the
usual thresholds (PyTorch's fused attention is not padded that way)."""
TINY_DSA = dict(index_topk=8, index_heads=2, index_dim=16, hidden_size=64, num_layers=2,
                num_heads=4, num_kv_heads=2, intermediate_size=128)
PROMPTS = [
    "The weather today is",
    "def add(a, b):",
    "Compute 17 * 23 and answer.",
    "Once upon a time",
]


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "consistency", help="compare rollout (vLLM) and trainer log-probs before and after a sync",
        description=__doc__.splitlines()[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", type=Path, help="Hugging Face checkpoint directory")
    src.add_argument("--dsa", action="store_true",
                     help="check a tiny random DeepSeek-sparse-attention model made on the spot")
    p.add_argument("--engine", choices=("auto", "vllm", "megatron"), default="auto",
                   help="rollout engine (auto: megatron for DSA checkpoints, else vllm)")
    p.add_argument("--dtype", choices=sorted(DEFAULT_THRESHOLDS), default="float32",
                   help="dtype both engines run in (default float32)")
    p.add_argument("--dsa-backend", choices=("auto", "torch", "triton"), default="auto",
                   help="DSA kernels for both sides (auto: Triton on GPUs, PyTorch reference on CPUs)")
    p.add_argument("--threshold", type=float, default=None,
                   help="max |log-prob diff| allowed (default: 1e-4 float32, 3e-2 bfloat16; "
                        "0 for a DSA model in float32)")
    p.add_argument("--samples", type=int, default=4, help="sequences sampled per version")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens sampled per sequence")
    p.add_argument("--lr", type=float, default=1e-3, help="learning rate of the training step")
    p.add_argument("--kv-cache-bytes", type=int, default=64 << 20,
                   help="KV cache the vLLM engine reserves (default 64 MiB)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling and the trainer")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.dsa:
        with tempfile.TemporaryDirectory() as tmp:
            from kiln.models.dsa import make_tiny_dsa_checkpoint

            args.model = make_tiny_dsa_checkpoint(Path(tmp) / "dsa-model", seed=args.seed, **TINY_DSA)
            return _run(args)
    if not (args.model / "config.json").exists():
        print(f"kiln consistency: --model {args.model} holds no config.json", file=sys.stderr)
        return 2
    return _run(args)


def _run(args: argparse.Namespace) -> int:
    from kiln.services.rollout.engine import engine_kind, is_dsa_checkpoint

    from kiln.api.capabilities import model_problems

    is_dsa = is_dsa_checkpoint(args.model)
    problems = model_problems(args.model, engine=engine_kind(args.engine, args.model), dtype=args.dtype)
    if problems:
        print(f"kiln consistency: --model {args.model}: {problems[0]}", file=sys.stderr)
        return 2
    if is_dsa and args.engine == "vllm":
        print("kiln consistency: --engine vllm cannot run a DSA checkpoint (config.json kiln_dsa); "
              "use --engine megatron", file=sys.stderr)
        return 2
    engine = engine_kind(args.engine, args.model)
    defaults = EXACT_THRESHOLDS if engine == "megatron" and is_dsa else DEFAULT_THRESHOLDS
    threshold = args.threshold if args.threshold is not None else defaults[args.dtype]
    rows, moved = asyncio.run(_compare(args, engine))
    ok = True
    print(f"engine {engine}, model {'DSA' if is_dsa else 'dense'}, dtype {args.dtype}")
    print(f"{'version':>7}  {'tokens':>6}  {'max|diff|':>10}  {'mean|diff|':>10}  result "
          f"(threshold {threshold:g})")
    for version, n, mx, mean, _ in rows:
        verdict = "OK" if mx <= threshold else "MISMATCH"
        ok &= verdict == "OK"
        print(f"{version:>7}  {n:>6}  {mx:>10.3e}  {mean:>10.3e}  {verdict}")
    if is_dsa:
        for version, _, _, _, (matched, total) in rows:
            verdict = "OK" if matched == total and total > 0 else "MISMATCH"
            ok &= verdict == "OK"
            print(f"version {version}: index hashes {matched}/{total} (sequence, layer) pairs match  {verdict}")
    print(f"the training step moved the trainer's log-probs of the version-0 tokens by "
          f"{moved:.3e} on average")
    return 0 if ok else 1


Row = tuple[int, int, float, float, tuple[int, int]]
"""version, tokens compared, max |diff|, mean |diff|, (index hashes matched, compared)."""


async def _compare(args: argparse.Namespace, engine_name: str) -> tuple[list[Row], float]:
    import grpc
    from transformers import AutoTokenizer

    from kiln.protos.kiln.v1 import weight_sync_pb2_grpc as pb_grpc
    from kiln.services.common.server import CHANNEL_OPTIONS, Registration, create_server
    from kiln.models.dsa import count_mismatches, set_backend
    from kiln.services.rollout.engine import EngineSettings, SamplingOptions, start_engine
    from kiln.services.trainer.config import OptimizerConfig, TrainerConfig
    from kiln.services.trainer.engine import TrainerEngine
    from kiln.services.weight_sync import client as ws
    from kiln.services.weight_sync.servicer import SERVICE_NAME, WeightSyncServicer
    from kiln.trajectory import Trajectory, VersionSpan

    tokenizer = AutoTokenizer.from_pretrained(str(args.model))
    prompts = [tokenizer.encode(PROMPTS[i % len(PROMPTS)]) or [0] for i in range(args.samples)]
    with tempfile.TemporaryDirectory() as tmp:
        trainer = TrainerEngine(TrainerConfig(
            model_dir=args.model, params_dtype=args.dtype, micro_batch_size=args.samples,
            optimizer=OptimizerConfig(lr=args.lr, grad_clip=0.0), checkpoint_dir=Path(tmp) / "ckpt",
            seed=args.seed), resume=False)
    set_backend(trainer.model, args.dsa_backend)
    settings = EngineSettings(model=str(args.model), dtype=args.dtype, kv_cache_bytes=args.kv_cache_bytes,
                              seed=args.seed)
    options = {"dsa_backend": args.dsa_backend} if engine_name == "megatron" else {}
    engine = await start_engine(engine_name, settings, **options)
    servicer = WeightSyncServicer()
    server, port = await create_server("127.0.0.1:0", [Registration(
        pb_grpc.add_WeightSyncServicer_to_server, servicer, SERVICE_NAME)])
    rows = []
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=CHANNEL_OPTIONS) as ch:
            receiver = ws.make_receiver(ch, "consistency", engine.apply_weights)
            sub = asyncio.create_task(ws.subscribe_and_apply(ch, "consistency", engine.apply_weights,
                                                             receiver=receiver))
            for round_ in range(2):
                sampling = SamplingOptions(temperature=1.0, max_tokens=args.max_tokens)
                gens = await asyncio.gather(*[
                    engine.generate(p, SamplingOptions(**{**sampling.__dict__, "seed": args.seed + i}))
                    for i, p in enumerate(prompts)])
                seqs = [p + g.token_ids for p, g in zip(prompts, gens)]
                train_lp = trainer.logprobs(seqs)
                diffs = []
                for p, g, lp in zip(prompts, gens, train_lp):
                    if set(g.versions) != {trainer.policy_version}:
                        raise RuntimeError(f"rollout tokens carry versions {set(g.versions)}, trainer "
                                           f"is at {trainer.policy_version}; the sync did not take effect")
                    diffs += [abs(a - b) for a, b in zip(g.logprobs, lp[len(p):])]
                hashes = [g.index_hashes for g in gens]
                total = sum(len(h) for h in hashes)
                matched = total - count_mismatches(hashes, trainer.index_hashes(seqs)) if total else 0
                rows.append((trainer.policy_version, len(diffs), max(diffs), statistics.fmean(diffs), (matched, total)))
                if round_ == 1:
                    break
                trajs = [Trajectory(
                    id=f"c{i}", task_id="consistency", group_id="consistency", tokens=s,
                    loss_mask=[0] * len(p) + [1] * len(g.token_ids),
                    logp_infer=[0.0] * len(p) + g.logprobs,
                    version_spans=[VersionSpan(len(p), len(s), g.versions[0])], prompt_len=len(p))
                    for i, (p, g, s) in enumerate(zip(prompts, gens, seqs))]
                trainer.sft_step(trajs)
                version = trainer.new_version()
                moved = statistics.fmean(
                    abs(a - b) for before, after, p in zip(train_lp, trainer.logprobs(seqs), prompts)
                    for a, b in zip(before[len(p):], after[len(p):]))
                await ws.publish(ch, version, trainer.named_hf_tensors())
                await asyncio.wait_for(receiver.wait_applied(version), 120)
            sub.cancel()
            await asyncio.gather(sub, return_exceptions=True)
    finally:
        await server.stop(0)
        await engine.close()
    return rows, moved
