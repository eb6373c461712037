"""Feasibility trial of the quickstart on CPU: does RL visibly fix what SFT imitated?

Plain PyTorch + transformers, no Kiln services. Steps:
1. train a tiny BPE tokenizer (digits single tokens, protocol tags special) on the chain corpus;
2. build a tiny Qwen2 from scratch;
3. SFT on `scripted_solver` trajectories (loss on actions only; prompt and observations masked);
   the solver drops the final 0 of a copied value that ends in 0 (75% of the time by default),
   so greedy decoding learns to as well;
4. evaluate on held-out tasks: greedy and sampled (T=1) success, and how often a value ending
   in 0 is copied correctly;
5. on-policy RL: G samples per task, reward 0/1 from `chain.verify`, group-relative advantage
   `r - mean(r)`, policy-gradient loss averaged over action tokens (the trial is fully on-policy,
   so Kiln's importance ratio is 1 and its masks never fire); evaluate every few steps.
Tool calls run in-process (`chain.run_tool_locally`, the same calculator code the sandbox runs).

Run: python benchmarks/quickstart/trial.py [--out DIR] [--rl-steps 40] [--save] ...
The defaults are the settings that worked (0.43M parameters, 1000 SFT steps, 40 RL steps).
Prints one line per phase/evaluation and writes DIR/results.json.

Not covered: vLLM rollout, Megatron training, the sandbox service, asynchrony.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import Qwen2Config, Qwen2ForCausalLM

from kiln.services.sandbox.environments import chain


# ----------------------------------------------------------------------------- tokenizer


def build_tokenizer(vocab_size: int = 320) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    # Digits are split one per pre-token, so no merge can ever join two digits.
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(chain.SPECIAL_TOKENS), min_frequency=1,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(chain.corpus_for_tokenizer(), trainer)
    return tok


class Codec:
    """Text <-> ids with the few ids the loop needs."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok = tok
        self.pad = tok.token_to_id("<pad>")
        self.stops = [tok.token_to_id(t) for t in chain.STOP_TAGS]

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=False)


# ----------------------------------------------------------------------------- model


def build_model(vocab: int, hidden: int, layers: int, heads: int, seed: int) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 3,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads // 2,
        max_position_embeddings=256, tie_word_embeddings=True, rope_theta=10000.0,
        attn_implementation="sdpa",
    )
    return Qwen2ForCausalLM(config)


#: bf16 autocast for training forward/backward (2-3x faster matmuls on AVX-512 bf16 CPUs).
BF16 = True


def token_logprobs(model, ids_BT: torch.Tensor, attn_BT: torch.Tensor) -> torch.Tensor:
    """log p(ids[:, t] | ids[:, <t]) for t >= 1; shape (B, T-1)."""
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=BF16):
        logits = model(input_ids=ids_BT, attention_mask=attn_BT).logits[:, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids_BT[:, 1:, None]).squeeze(-1)


def pad_right(seqs: list[list[int]], value: int) -> torch.Tensor:
    n = max(len(s) for s in seqs)
    return torch.tensor([s + [value] * (n - len(s)) for s in seqs])


# ----------------------------------------------------------------------------- episodes


@dataclass
class Episode:
    task: chain.ChainTask
    ids: list[int]
    mask: list[int]
    text: str = ""
    done: bool = False
    reward: float = 0.0
    answer: str | None = None
    actions: list[str] = field(default_factory=list)


@torch.no_grad()
def rollout(model, codec: Codec, tasks: list[chain.ChainTask], samples: int, greedy: bool,
            max_new: int = 20) -> list[Episode]:
    """Run every task `samples` times: generate an action, run the tool, append the
    observation, repeat until an answer, an invalid action or MAX_ACTIONS."""
    model.eval()
    eps = []
    for task in tasks:
        prompt = codec.encode(task.prompt)
        eps += [Episode(task, list(prompt), [0] * len(prompt), task.prompt) for _ in range(samples)]
    for _ in range(chain.MAX_ACTIONS):
        active = [e for e in eps if not e.done]
        if not active:
            break
        n = max(len(e.ids) for e in active)
        ids = torch.tensor([[codec.pad] * (n - len(e.ids)) + e.ids for e in active])
        attn = torch.tensor([[0] * (n - len(e.ids)) + [1] * len(e.ids) for e in active])
        out = model.generate(
            input_ids=ids, attention_mask=attn, max_new_tokens=max_new, do_sample=not greedy,
            temperature=1.0, top_p=1.0, eos_token_id=codec.stops,
            pad_token_id=codec.pad,
        )[:, n:].tolist()
        for e, gen in zip(active, out):
            cut = next((i + 1 for i, t in enumerate(gen) if t in codec.stops), len(gen))
            gen = gen[:cut]
            text = codec.decode(gen)
            e.ids += gen
            e.mask += [1] * len(gen)
            e.text += text
            e.actions.append(text)
            action = chain.parse_action(text)
            if isinstance(action, (chain.Call, chain.Step)):
                obs = chain.run_tool_locally(chain.tool_call(e.task, action))
                obs_ids = codec.encode(obs)
                e.ids += obs_ids
                e.mask += [0] * len(obs_ids)
                e.text += obs
            else:
                e.done = True
                e.answer = action.value if isinstance(action, chain.Answer) else None
    for e in eps:
        e.done = True
        e.reward = chain.verify(e.task, e.answer)[0]
    return eps


_SEGMENT_RE = re.compile(r"<(obs|call|answer)>([^<]*)</\1>")


def zero_copy_stats(eps: list[Episode]) -> tuple[int, int]:
    """(copies of an observation ending in 0 done right, such copies): the solver's blind
    spot, measured on what the model did."""
    good = total = 0
    for e in eps:
        segments = [(m.group(1), m.group(2)) for m in _SEGMENT_RE.finditer(e.text)]
        for (kind, observed), (_, body) in zip(segments, segments[1:]):
            if kind == "obs" and chain.triggers_mistake(observed):
                copied = re.match(r"(?:calc |step )?(-?[0-9]*)", body.strip()).group(1)
                total += 1
                good += copied == observed
    return good, total


def evaluate(model, codec: Codec, tasks, samples: int) -> dict:
    t0 = time.time()
    greedy = rollout(model, codec, tasks, 1, greedy=True)
    sampled = rollout(model, codec, tasks, samples, greedy=False)
    g_good, g_total = zero_copy_stats(greedy)
    s_good, s_total = zero_copy_stats(sampled)
    return {
        "greedy": sum(e.reward for e in greedy) / len(greedy),
        "sampled": sum(e.reward for e in sampled) / len(sampled),
        "zero_copy_greedy": g_good / max(g_total, 1),
        "zero_copy_sampled": s_good / max(s_total, 1),
        "eval_s": round(time.time() - t0, 1),
    }


# ----------------------------------------------------------------------------- SFT


def sft_examples(codec: Codec, tasks, rng: random.Random, mistake_rate: float,
                 slip_rate: float) -> list[tuple[list[int], list[int]]]:
    out = []
    for task in tasks:
        turns = chain.scripted_solver(task, rng, mistake_rate=mistake_rate, slip_rate=slip_rate)
        ids, mask = [], []
        for text, trained in chain.render(task, turns):
            piece = codec.encode(text)
            ids += piece
            mask += [int(trained)] * len(piece)
        out.append((ids, mask))
    return out


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(total - warmup, 1)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def sft(model, codec: Codec, examples, steps: int, batch: int, lr: float, log,
        probe=None, probe_every: int = 0) -> None:
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.95))
    rng = random.Random(0)
    model.train()
    t0 = time.time()
    for step in range(steps):
        chunk = rng.sample(examples, batch)
        ids = pad_right([c[0] for c in chunk], codec.pad)
        mask = pad_right([c[1] for c in chunk], 0)[:, 1:].float()
        attn = pad_right([[1] * len(c[0]) for c in chunk], 0)
        logp = token_logprobs(model, ids, attn)
        loss = -(logp * mask).sum() / mask.sum()
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps, lr, warmup=20)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 50 == 0 or step == steps - 1:
            log(f"sft step {step} loss {loss.item():.4f} t={time.time() - t0:.0f}s")
        if probe and probe_every and (step + 1) % probe_every == 0 and step + 1 < steps:
            log(f"sft step {step + 1} probe {probe()}")
            model.train()


# ----------------------------------------------------------------------------- RL


def rl_step(model, opt, codec: Codec, tasks, group: int) -> dict:
    t0 = time.time()
    eps = rollout(model, codec, tasks, group, greedy=False)
    t_roll = time.time() - t0
    rewards = torch.tensor([e.reward for e in eps]).view(len(tasks), group)
    adv = (rewards - rewards.mean(1, keepdim=True)).view(-1)
    model.train()
    ids = pad_right([e.ids for e in eps], codec.pad)
    attn = pad_right([[1] * len(e.ids) for e in eps], 0)
    mask = pad_right([e.mask for e in eps], 0)[:, 1:].float()
    logp = token_logprobs(model, ids, attn)
    # Token-mean policy gradient: every action token of a sample carries its group advantage.
    loss = -(logp * mask * adv[:, None]).sum() / mask.sum()
    opt.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    mixed = int(((rewards.max(1).values - rewards.min(1).values) > 0).sum())
    return {"reward": rewards.mean().item(), "mixed_groups": mixed,
            "rollout_s": round(t_roll, 1), "step_s": round(time.time() - t0, 1)}


# ----------------------------------------------------------------------------- main


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="/tmp/kiln-quickstart-trial")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads; 2 is far slower than 1 when other jobs share the cores")
    p.add_argument("--fp32", action="store_true", help="train in fp32 instead of bf16 autocast")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-steps", type=int, default=4, help="tool calls per task")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--mistake-rate", type=float, default=0.75)
    p.add_argument("--slip-rate", type=float, default=0.0)
    p.add_argument("--sft-tasks", type=int, default=6000)
    p.add_argument("--sft-steps", type=int, default=1000)
    p.add_argument("--sft-batch", type=int, default=32)
    p.add_argument("--sft-lr", type=float, default=5e-3)
    p.add_argument("--sft-probe-every", type=int, default=0,
                   help="greedy held-out success every N SFT steps (0: never)")
    p.add_argument("--rl-steps", type=int, default=40)
    p.add_argument("--rl-tasks", type=int, default=16, help="tasks per RL step")
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--rl-lr", type=float, default=3e-4)
    p.add_argument("--eval-tasks", type=int, default=200)
    p.add_argument("--eval-samples", type=int, default=2, help="sampled episodes per task")
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument("--save", action="store_true", help="save tokenizer and checkpoints")
    p.add_argument("--load-sft", default=None,
                   help="skip SFT: load DIR/sft and DIR/tokenizer.json written by an earlier --save run")
    args = p.parse_args()

    torch.set_num_threads(args.threads)
    global BF16
    BF16 = not args.fp32
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.time()

    def log(msg: str) -> None:
        print(f"[{time.time() - t_start:6.1f}s] {msg}", flush=True)

    if args.load_sft:
        codec = Codec(Tokenizer.from_file(str(Path(args.load_sft) / "tokenizer.json")))
        model = Qwen2ForCausalLM.from_pretrained(Path(args.load_sft) / "sft")
    else:
        codec = Codec(build_tokenizer())
        model = build_model(codec.tok.get_vocab_size(), args.hidden, args.layers, args.heads,
                            args.seed)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"vocab {codec.tok.get_vocab_size()} params {n_params / 1e6:.2f}M")

    heldout = chain.generate_tasks(args.eval_tasks, seed=1000 + args.seed, split="heldout",
                                   num_steps=args.num_steps)
    sft_tasks = chain.generate_tasks(args.sft_tasks, seed=args.seed, num_steps=args.num_steps)
    examples = sft_examples(codec, sft_tasks, random.Random(args.seed), args.mistake_rate,
                            args.slip_rate)
    solver_ok = sum(chain.verify(t, chain.final_answer(chain.scripted_solver(
        t, random.Random(i), mistake_rate=args.mistake_rate, slip_rate=args.slip_rate)))[0]
        for i, t in enumerate(heldout)) / len(heldout)
    log(f"solver success on held-out {solver_ok:.3f}; sft examples {len(examples)}, "
        f"mean length {sum(len(e[0]) for e in examples) / len(examples):.0f} tokens")

    t0 = time.time()
    def probe() -> float:
        eps = rollout(model, codec, heldout[:100], 1, greedy=True)
        return sum(e.reward for e in eps) / len(eps)

    sft(model, codec, examples, args.sft_steps, args.sft_batch, args.sft_lr, log, probe,
        args.sft_probe_every)
    sft_s = time.time() - t0
    before = evaluate(model, codec, heldout, args.eval_samples)
    log(f"after SFT ({sft_s:.0f}s): {before}")
    log("greedy sample: " + rollout(model, codec, heldout[:1], 1, greedy=True)[0].text)
    if args.save and not args.load_sft:
        model.save_pretrained(out / "sft")
        codec.tok.save(str(out / "tokenizer.json"))

    opt = torch.optim.AdamW(model.parameters(), lr=args.rl_lr, weight_decay=0.0,
                            betas=(0.9, 0.99))
    rl_tasks = chain.generate_tasks(args.rl_steps * args.rl_tasks, seed=500 + args.seed,
                                    num_steps=args.num_steps)
    curve = [{"step": 0, **before}]
    steps_log = []
    t0 = time.time()
    for step in range(1, args.rl_steps + 1):
        batch = rl_tasks[(step - 1) * args.rl_tasks: step * args.rl_tasks]
        info = rl_step(model, opt, codec, batch, args.group)
        steps_log.append({"step": step, **info})
        log(f"rl step {step} {info}")
        if step % args.eval_every == 0 or step == args.rl_steps:
            ev = evaluate(model, codec, heldout, args.eval_samples)
            curve.append({"step": step, "rl_s": round(time.time() - t0, 1), **ev})
            log(f"eval after rl step {step}: {ev}")
    rl_s = time.time() - t0
    if args.save:
        model.save_pretrained(out / "rl")
    result = {
        "args": vars(args), "params": n_params, "solver_heldout_success": solver_ok,
        "sft_s": round(sft_s, 1), "rl_s": round(rl_s, 1),
        "total_s": round(time.time() - t_start, 1), "eval_curve": curve, "rl_steps": steps_log,
    }
    (out / "results.json").write_text(json.dumps(result, indent=1))
    log(f"done: greedy {curve[0]['greedy']:.3f} -> {curve[-1]['greedy']:.3f}, sampled "
        f"{curve[0]['sampled']:.3f} -> {curve[-1]['sampled']:.3f}; sft {sft_s:.0f}s rl {rl_s:.0f}s")


if __name__ == "__main__":
    main()
