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

For a mixture-of-experts checkpoint (Qwen2-MoE, Qwen3-MoE) the rollout engine is `megatron` too
(vLLM's CPU build cannot return the experts it routes to): it records the experts it chose for every token,
and the trainer scores the tokens twice, replaying that routing (`--routing-replay on`, the
default: the verdict rows) and with its own top-k; the routing-flip rate is the share of
(token, layer) pairs where the trainer's own top-k differs from the rollout's. `--engine torch`
samples with transformers and its KV cache instead, an implementation independent of the
trainer's MoE layers (as vLLM is in production), whose flips show what replay removes.

It prints, per version, the max and mean |log-prob difference| over the sampled tokens and OK or
MISMATCH against `--threshold` (default 1e-4 in float32, 3e-2 in bfloat16, 0 for a DSA model
in float32), then for DSA models the index-hash matches, for MoE models the mismatch without
replay and the routing-flip rate, and exits 3 on any MISMATCH. With `--lora-rank R` the trainer
trains a LoRA adapter (`kiln.models.lora`, every projection targeted, alpha `--lora-alpha`) on
the frozen checkpoint, the sync ships only the adapter, and the engine merges it into its base
weights before the reload (`rollout/lora_merge.py`); the bytes a version carried are printed
beside the model's. Not covered: tensor parallelism
(the trainer runs TP=1 here) and sequences longer than `--max-tokens` plus the prompt.
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from kiln.cli.conventions import byte_quantity
from kiln.cli.exits import Exit

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
    p.add_argument("--engine", choices=("auto", "vllm", "megatron", "torch"), default="auto",
                   help="rollout engine (auto: megatron for DSA and MoE checkpoints, else vllm; torch: "
                        "transformers with a KV cache, an independent implementation)")
    p.add_argument("--dtype", choices=sorted(DEFAULT_THRESHOLDS), default="float32",
                   help="dtype both engines run in (default float32)")
    p.add_argument("--dsa-backend", choices=("auto", "torch", "triton"), default="auto",
                   help="DSA kernels for both sides (auto: Triton on GPUs, PyTorch reference on CPUs)")
    p.add_argument("--threshold", type=float, default=None,
                   help="max |log-prob diff| allowed (default: 1e-4 float32, 3e-2 bfloat16; "
                        "0 for a DSA model in float32)")
    p.add_argument("--routing-replay", choices=("on", "off"), default="on",
                   help="MoE models: score with the rollout's routing replayed (on, default) or the "
                        "trainer's own (off); both are measured, this picks the verdict rows")
    p.add_argument("--samples", type=int, default=4, help="sequences sampled per version")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens sampled per sequence")
    p.add_argument("--lr", type=float, default=1e-3, help="learning rate of the training step")
    p.add_argument("--kv-cache-bytes", type=byte_quantity("--kv-cache-bytes"), default="64Mi",
                   help="KV cache the vLLM engine reserves, a Kubernetes quantity or a number of "
                        "bytes (default 64Mi)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling and the trainer")
    p.add_argument("--lora-rank", type=int, default=None,
                   help="train a LoRA adapter of this rank instead of all weights (default: none)")
    p.add_argument("--lora-alpha", type=float, default=16.0, help="LoRA alpha (with --lora-rank)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.dsa:
        with tempfile.TemporaryDirectory() as tmp:
            from kiln.models.dsa import make_tiny_dsa_checkpoint

            args.model = make_tiny_dsa_checkpoint(Path(tmp) / "dsa-model", seed=args.seed, **TINY_DSA)
            return _run(args)
    if not (args.model / "config.json").exists():
        print(f"kiln consistency: --model {args.model} holds no config.json", file=sys.stderr)
        return Exit.REFUSED
    return _run(args)


def _run(args: argparse.Namespace) -> int:
    from kiln.services.rollout.engine import engine_kind, is_dsa_checkpoint

    from kiln.api.capabilities import is_moe_config, model_problems
    from kiln.models.tiny import read_config

    is_dsa = is_dsa_checkpoint(args.model)
    is_moe = is_moe_config(read_config(args.model))
    problems = model_problems(args.model, engine=engine_kind(args.engine, args.model), dtype=args.dtype)
    if problems:
        print(f"kiln consistency: --model {args.model}: {problems[0]}", file=sys.stderr)
        return Exit.REFUSED
    if is_dsa and args.engine in ("vllm", "torch"):
        print(f"kiln consistency: --engine {args.engine} cannot run a DSA checkpoint (config.json kiln_dsa); "
              "use --engine megatron", file=sys.stderr)
        return Exit.REFUSED
    engine = engine_kind(args.engine, args.model)
    defaults = EXACT_THRESHOLDS if engine == "megatron" and is_dsa else DEFAULT_THRESHOLDS
    threshold = args.threshold if args.threshold is not None else defaults[args.dtype]
    if args.lora_rank is not None and (is_dsa or is_moe):
        print("kiln consistency: --lora-rank: LoRA covers dense models only", file=sys.stderr)
        return Exit.REFUSED
    if args.lora_rank is not None and args.lora_rank < 1:
        print(f"kiln consistency: --lora-rank {args.lora_rank}: expected a rank >= 1", file=sys.stderr)
        return Exit.REFUSED
    rows, moved = asyncio.run(_compare(args, engine))
    ok = True
    replay = is_moe and args.routing_replay == "on"
    kind = "DSA" if is_dsa else "MoE" if is_moe else "dense"
    print(f"engine {engine}, model {kind}, dtype {args.dtype}"
          + (f", routing replay {args.routing_replay}" if is_moe else ""))
    print(f"{'version':>7}  {'tokens':>6}  {'max|diff|':>10}  {'mean|diff|':>10}  result "
          f"(threshold {threshold:g})")
    for row in rows:
        mx, mean = (row.max, row.mean) if replay or not is_moe else (row.own_max, row.own_mean)
        verdict = "OK" if mx <= threshold else "MISMATCH"
        ok &= verdict == "OK"
        print(f"{row.version:>7}  {row.tokens:>6}  {mx:>10.3e}  {mean:>10.3e}  {verdict}")
    if is_dsa:
        for row in rows:
            matched, total = row.hashes
            verdict = "OK" if matched == total and total > 0 else "MISMATCH"
            ok &= verdict == "OK"
            print(f"version {row.version}: index hashes {matched}/{total} (sequence, layer) pairs match  {verdict}")
    if is_moe:
        other = "without" if replay else "with"
        for row in rows:
            mx, mean = (row.own_max, row.own_mean) if replay else (row.max, row.mean)
            print(f"version {row.version} {other} replay: max|diff| {mx:.3e}, mean|diff| {mean:.3e}")
        flips, compared = sum(r.flips for r in rows), sum(r.compared for r in rows)
        rate = flips / compared if compared else 0.0
        print(f"routing-flip rate {rate:.3%}: {flips} of {compared} (token, layer) pairs the trainer "
              f"routes differently from rollout without replay")
    print(f"the training step moved the trainer's log-probs of the version-0 tokens by "
          f"{moved:.3e} on average")
    if args.lora_rank is not None:
        print(f"lora rank {args.lora_rank}: a version carried {args.sync_bytes} bytes, the model is "
              f"{args.model_bytes} bytes")
    return Exit.OK if ok else Exit.PROBLEMS_FOUND


@dataclass
class Row:
    version: int
    tokens: int
    """Sampled tokens compared."""
    max: float
    """max |log-prob diff| (MoE: with the rollout's routing replayed)."""
    mean: float
    hashes: tuple[int, int] = (0, 0)
    """DSA: (index hashes matched, compared)."""
    own_max: float = 0.0
    """MoE: max |diff| with the trainer's own routing."""
    own_mean: float = 0.0
    flips: int = 0
    """MoE: (token, layer) pairs whose trainer routing differs from rollout's."""
    compared: int = 0


async def _compare(args: argparse.Namespace, engine_name: str) -> tuple[list[Row], float]:
    import grpc
    from transformers import AutoTokenizer

    from kiln.protos.kiln.v1 import weight_sync_pb2_grpc as pb_grpc
    from kiln.control.channels import CHANNEL_OPTIONS
    from kiln.services.common.server import Registration, create_server
    from kiln.models.dsa import count_mismatches, set_backend
    from kiln.services.rollout.engine import EngineSettings, SamplingOptions, start_engine
    from kiln.api.model import LoraSpec
    from kiln.models.hf_io import iter_hf_tensors
    from kiln.services.trainer.config import OptimizerConfig, TrainerConfig
    from kiln.services.trainer.engine import TrainerEngine
    from kiln.services.weight_sync import client as ws
    from kiln.services.weight_sync.servicer import SERVICE_NAME, WeightSyncServicer
    from kiln.trajectory import Trajectory, VersionSpan

    tokenizer = AutoTokenizer.from_pretrained(str(args.model))
    prompts = [tokenizer.encode(PROMPTS[i % len(PROMPTS)]) or [0] for i in range(args.samples)]
    lora = LoraSpec(rank=args.lora_rank, alpha=args.lora_alpha) if args.lora_rank is not None else None
    with tempfile.TemporaryDirectory() as tmp:
        trainer = TrainerEngine(TrainerConfig(
            model_dir=args.model, params_dtype=args.dtype, micro_batch_size=args.samples,
            optimizer=OptimizerConfig(lr=args.lr, grad_clip=0.0), checkpoint_dir=Path(tmp) / "ckpt",
            seed=args.seed, lora=lora), resume=False)
    set_backend(trainer.model, args.dsa_backend)
    settings = EngineSettings(model=str(args.model), dtype=args.dtype, kv_cache_bytes=args.kv_cache_bytes,
                              seed=args.seed, record_routing=True,
                              lora_scaling=lora.scaling if lora is not None else None)
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
                routed = [g.routed_experts for g in gens]
                own_lp = trainer.logprobs(seqs)
                train_lp, flips = (trainer.logprobs_routed(seqs, routed, replay=True)
                                   if any(routed) else (own_lp, None))

                def diffs_of(lps):
                    return [abs(a - b) for p, g, lp in zip(prompts, gens, lps)
                            for a, b in zip(g.logprobs, lp[len(p):])]

                for g in gens:
                    if set(g.versions) != {trainer.policy_version}:
                        raise RuntimeError(f"rollout tokens carry versions {set(g.versions)}, trainer "
                                           f"is at {trainer.policy_version}; the sync did not take effect")
                diffs, own = diffs_of(train_lp), diffs_of(own_lp)
                hashes = [g.index_hashes for g in gens]
                total = sum(len(h) for h in hashes)
                matched = total - count_mismatches(hashes, trainer.index_hashes(seqs)) if total else 0
                rows.append(Row(trainer.policy_version, len(diffs), max(diffs), statistics.fmean(diffs),
                                (matched, total), max(own), statistics.fmean(own),
                                flips.flips if flips else 0, flips.compared if flips else 0))
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
                    abs(a - b) for before, after, p in zip(own_lp, trainer.logprobs(seqs), prompts)
                    for a, b in zip(before[len(p):], after[len(p):]))
                payload = list(trainer.named_hf_tensors())
                args.sync_bytes = sum(t.numel() * t.element_size() for _, t in payload)
                args.model_bytes = sum(t.numel() * t.element_size()
                                       for _, t in iter_hf_tensors(trainer.model, trainer.spec))
                await ws.publish(ch, version, payload)
                await asyncio.wait_for(receiver.wait_applied(version), 120)
            sub.cancel()
            await asyncio.gather(sub, return_exceptions=True)
    finally:
        await server.stop(0)
        await engine.close()
    return rows, moved
