"""The `megatron` rollout engine on a tiny DSA model against the real trainer: bit-identical
log-probs, matching index hashes, exact per-token versions across a weight update, and
`kiln consistency --dsa` end to end."""
from __future__ import annotations

import asyncio
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kiln.models import dsa
from kiln.models.megatron_model import token_logprobs
from kiln.models.tiny import make_tiny_checkpoint
from kiln.services.rollout.engine import EngineSettings, SamplingOptions
from kiln.services.rollout.megatron_engine import MegatronEngine
from kiln.services.trainer.config import OptimizerConfig, TrainerConfig
from kiln.services.trainer.engine import TrainerEngine
from kiln.trajectory import Trajectory, VersionSpan

TINY = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128)
PROMPTS = [[1, 40, 41, 42, 43], [1, 7, 300, 12], [1, 99] * 5]


@pytest.fixture(scope="module")
def dsa_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return dsa.make_tiny_dsa_checkpoint(tmp_path_factory.mktemp("dsa") / "m", index_topk=8, seed=5, **TINY)


def _trainer(model_dir: Path, tmp: Path, lr: float = 1e-2) -> TrainerEngine:
    engine = TrainerEngine(TrainerConfig(
        model_dir=model_dir, micro_batch_size=4, optimizer=OptimizerConfig(lr=lr, grad_clip=0.0),
        checkpoint_dir=tmp / "ckpt"), resume=False)
    dsa.set_backend(engine.model, "torch")
    return engine


async def _engine(model_dir: Path, tempered: bool = False) -> MegatronEngine:
    return await MegatronEngine.start(EngineSettings(model=str(model_dir), dtype="float32", seed=0,
                                                     tempered_logprobs=tempered), dsa_backend="torch")


def _sampling(seed: int, max_tokens: int = 20, temperature: float = 1.0) -> SamplingOptions:
    return SamplingOptions(temperature=temperature, max_tokens=max_tokens, seed=seed)


async def test_generations_match_the_trainer_bit_for_bit(dsa_dir: Path, tmp_path: Path) -> None:
    engine = await _engine(dsa_dir)
    trainer = _trainer(dsa_dir, tmp_path)
    assert "dsa=topk8/h2/d16/torch" in engine.fingerprint
    gens = [await engine.generate(p, _sampling(i)) for i, p in enumerate(PROMPTS)]
    seqs = [p + g.token_ids for p, g in zip(PROMPTS, gens)]
    assert all(len(g.token_ids) == 20 or g.finish_reason == "stop" for g in gens)
    assert max(len(s) for s in seqs) > 16  # well past k = 8: the selection is really sparse
    for p, g, lp in zip(PROMPTS, gens, trainer.logprobs(seqs)):
        assert g.logprobs == lp[len(p):]  # exact float equality, token by token
        assert g.versions == [0] * len(g.token_ids)
    # Scoring (a teacher's job) is the trainer's own computation: the same bits.
    assert await engine.score(seqs) == trainer.logprobs(seqs)
    # With a top k (dense distillation): the k most likely in each place, in order, and the
    # sampled token's own log-prob among them whenever it ranks in the k.
    for seq, (lp, ids, lps) in zip(seqs, await engine.score_topk(seqs, 4)):
        assert len(ids) == len(lps) == 4 * len(seq) and ids[:4] == [0] * 4
        assert lp == pytest.approx(trainer.logprobs([seq])[0], abs=1e-5)
        for t in range(1, len(seq)):
            top = lps[4 * t:4 * t + 4]
            assert top == sorted(top, reverse=True) and lp[t] <= top[0] + 1e-5
            if seq[t] in ids[4 * t:4 * t + 4]:
                assert top[ids[4 * t:4 * t + 4].index(seq[t])] == pytest.approx(lp[t], abs=1e-5)
    hashes = [g.index_hashes for g in gens]
    assert all(len(h) == 2 for h in hashes)
    assert dsa.count_mismatches(hashes, trainer.index_hashes(seqs)) == 0
    # A different sequence selects different keys: the hashes see the tokens.
    other = [s[:-2] + [(s[-2] + 1) % 300, s[-1]] for s in seqs]
    assert dsa.count_mismatches(hashes, trainer.index_hashes(other)) > 0
    # Same seed, same everything.
    again = await engine.generate(PROMPTS[0], _sampling(0))
    assert (again.token_ids, again.logprobs, again.index_hashes) == (
        gens[0].token_ids, gens[0].logprobs, gens[0].index_hashes)
    await engine.close()


async def test_weights_change_between_decoding_steps_with_exact_versions(dsa_dir: Path, tmp_path: Path) -> None:
    engine = await _engine(dsa_dir)
    old = _trainer(dsa_dir, tmp_path / "old")
    new = _trainer(dsa_dir, tmp_path / "new")
    seqs = [p + [50 + i for i in range(12)] for p in PROMPTS]
    new.sft_step([Trajectory(id=f"s{i}", task_id="t", group_id="g", tokens=s, loss_mask=[0] * 4 + [1] * (len(s) - 4),
                             logp_infer=[0.0] * len(s), version_spans=[VersionSpan(4, len(s), 0)])
                  for i, s in enumerate(seqs)])
    assert new.new_version() == 1
    weights = [(n, t.clone()) for n, t in new.named_hf_tensors()]

    task = asyncio.create_task(engine.generate(PROMPTS[0], _sampling(3, max_tokens=16)))
    await asyncio.sleep(0)  # the first decoding step takes the lock; the update queues behind it
    await engine.apply_weights(1, weights)
    gen = await task
    assert engine.policy_version == 1
    v = gen.versions
    assert v[0] == 0 and v[-1] == 1 and v == sorted(v)
    seq = PROMPTS[0] + gen.token_ids
    lp_old, lp_new = old.logprobs([seq])[0], new.logprobs([seq])[0]
    for i, (logp, version) in enumerate(zip(gen.logprobs, v)):
        assert logp == (lp_old if version == 0 else lp_new)[len(PROMPTS[0]) + i], i
    # The hashes are those of the last step, i.e. of the newest version.
    assert dsa.count_mismatches([gen.index_hashes], new.index_hashes([seq])) == 0
    await engine.close()


async def test_incomplete_or_foreign_weights_are_rejected(dsa_dir: Path) -> None:
    engine = await _engine(dsa_dir)
    from kiln.models.hf_io import read_hf_state_dict

    hf = read_hf_state_dict(dsa_dir)
    partial = [(n, t) for n, t in hf.items() if ".indexer." not in n]
    with pytest.raises(ValueError, match="indexer"):
        await engine.apply_weights(1, partial)
    with pytest.raises(ValueError, match="not weights of the model"):
        await engine.apply_weights(1, [*hf.items(), ("model.layers.9.extra.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match="shape"):
        await engine.apply_weights(1, [(n, t[:1] if n == "model.norm.weight" else t) for n, t in hf.items()])
    assert engine.policy_version == 0
    await engine.apply_weights(1, hf.items())
    assert engine.policy_version == 1
    await engine.close()


async def test_at_a_temperature_the_recorded_logprobs_are_the_trainers_at_it(dsa_dir: Path, tmp_path: Path) -> None:
    # A job sampling at 2.0: rollout records log softmax(logits / 2), and so does the RL step.
    engine = await _engine(dsa_dir, tempered=True)
    trainer = _trainer(dsa_dir, tmp_path)
    assert engine.fingerprint.endswith("logprobs=tempered")
    gens = [await engine.generate(p, _sampling(i, temperature=2.0)) for i, p in enumerate(PROMPTS)]
    greedy = await engine.generate(PROMPTS[0], _sampling(0, temperature=0.0))
    seqs = [p + g.token_ids for p, g in zip(PROMPTS, gens)]
    tokens = torch.nn.utils.rnn.pad_sequence([torch.tensor(s) for s in seqs], batch_first=True)
    with torch.no_grad():
        hot = token_logprobs(trainer.model.eval(), tokens, temperature=2.0)
    raw = trainer.logprobs(seqs)
    for p, g, s, h, r in zip(PROMPTS, gens, seqs, hot, raw):
        assert g.logprobs == h[len(p):len(s)].tolist()  # bit for bit, at the temperature
        assert g.logprobs != r[len(p):]  # and not the raw distribution's
    # Greedy requests record the raw distribution's, as vLLM's processed mode does.
    assert greedy.logprobs == trainer.logprobs([PROMPTS[0] + greedy.token_ids])[0][len(PROMPTS[0]):]
    await engine.close()


async def test_dense_checkpoint_runs_without_index_hashes(tmp_path: Path) -> None:
    model_dir = make_tiny_checkpoint(tmp_path / "dense", seed=1, **TINY)
    engine = await _engine(model_dir)
    trainer = _trainer(model_dir, tmp_path)
    gen = await engine.generate(PROMPTS[1], _sampling(1, max_tokens=8))
    assert gen.index_hashes == [] and "dsa=off" in engine.fingerprint
    lp = trainer.logprobs([PROMPTS[1] + gen.token_ids])[0][len(PROMPTS[1]):]
    assert max(abs(a - b) for a, b in zip(gen.logprobs, lp)) < 1e-5
    await engine.close()


@pytest.mark.slow
def test_consistency_command_on_a_tiny_dsa_model() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kiln.cli.main", "consistency", "--dsa", "--dsa-backend", "torch",
         "--samples", "3", "--max-tokens", "16"],
        capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "engine megatron, model DSA, dtype float32" in proc.stdout
    rows = re.findall(r"^\s+(\d+)\s+(\d+)\s+(\S+)\s+(\S+)\s+(OK|MISMATCH)$", proc.stdout, re.M)
    assert [r[0] for r in rows] == ["0", "1"], proc.stdout
    for _, n, mx, mean, verdict in rows:
        assert int(n) > 0 and float(mx) == 0.0 and float(mean) == 0.0 and verdict == "OK"
    hashes = re.findall(r"^version (\d): index hashes (\d+)/(\d+) .* (OK|MISMATCH)$", proc.stdout, re.M)
    assert hashes == [("0", "6", "6", "OK"), ("1", "6", "6", "OK")], proc.stdout
    moved = float(re.search(r"by (\S+) on average", proc.stdout).group(1))
    assert moved > 1e-3
