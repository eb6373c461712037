"""The stage loop with the in-process batch source and publishers."""
from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from kiln.models.tiny import make_tiny_checkpoint
from kiln.services.trainer.config import OptimizerConfig, TrainerConfig
from kiln.services.trainer.engine import TrainerEngine
from kiln.models.hf_io import read_hf_state_dict
from kiln.services.trainer.loop import (
    DirectoryPublisher,
    InMemoryPublisher,
    ListBatchSource,
    StageSettings,
    iter_versions,
    run_stage,
)
from kiln.trajectory import Trajectory, VersionSpan


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("loop") / "m", hidden_size=64, intermediate_size=128)


def _trajs(n: int, seed: int = 0) -> list[Trajectory]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        tokens = [rng.randrange(4, 300) for _ in range(10)]
        out.append(Trajectory(
            id=f"t{i}", task_id="x", group_id=f"g{i // 2}", tokens=tokens, loss_mask=[0, 0] + [1] * 8,
            logp_infer=[0.0, 0.0] + [-5.7] * 8, version_spans=[VersionSpan(2, 10, 0)],
            reward=(-1.0) ** i,  # groups of two, of mean 0: advantages +-1
        ))
    return out


def _engine(model_dir: Path) -> TrainerEngine:
    return TrainerEngine(TrainerConfig(model_dir=model_dir, micro_batch_size=2, optimizer=OptimizerConfig(lr=1e-3)))


def test_sft_stage_runs_until_source_is_exhausted_and_publishes_final_weights(model_dir: Path) -> None:
    engine = _engine(model_dir)
    pub = InMemoryPublisher()
    res = run_stage(engine, ListBatchSource(_trajs(5)), pub, StageSettings(kind="sft", max_steps=10, batch_size=2))
    assert res.steps == 3 and [m.sequences for m in res.metrics] == [2, 2, 1]
    assert res.versions == [1] and pub.versions == [1] and engine.policy_version == 1
    live = dict(engine.named_hf_tensors())
    assert pub.latest.keys() == live.keys() and all(torch.equal(pub.latest[k], live[k]) for k in live)
    assert any(not torch.equal(pub.latest[k], v) for k, v in read_hf_state_dict(model_dir).items())


def test_rl_stage_publishes_every_sync_interval(model_dir: Path) -> None:
    engine = _engine(model_dir)
    pub = InMemoryPublisher(keep_all=True)
    steps: list[float] = []
    res = run_stage(
        # Batches of 2 of 4 in groups of two: each batch holds whole groups, as the buffer's.
        engine, ListBatchSource(_trajs(4), cycle=True), pub,
        StageSettings(kind="rl", name="reasoning", max_steps=5, batch_size=2, sync_interval=2),
        on_step=lambda m: steps.append(m.step),
    )
    # Steps 2 and 4 publish by interval; step 5 publishes the stage's final weights.
    assert res.steps == 5 and steps == [1, 2, 3, 4, 5]
    assert res.versions == pub.versions == [1, 2, 3]
    assert [m.policy_version for m in res.metrics] == [0, 0, 1, 1, 2]
    w1, w2 = pub.weights[1], pub.weights[2]
    assert any(not torch.equal(w1[k], w2[k]) for k in w1)
    # Published copies do not follow later training.
    assert any(not torch.equal(w1[k], v) for k, v in engine.named_hf_tensors())
    assert engine.stage == "reasoning"


def test_should_stop_ends_the_stage(model_dir: Path) -> None:
    engine = _engine(model_dir)
    calls = []
    res = run_stage(
        engine, ListBatchSource(_trajs(2), cycle=True), InMemoryPublisher(),
        StageSettings(kind="sft", max_steps=100, batch_size=1), should_stop=lambda: calls.append(1) or len(calls) > 2,
    )
    assert res.steps == 2 and res.versions == [1]


def test_directory_publisher_writes_loadable_checkpoints(model_dir: Path, tmp_path: Path) -> None:
    engine = _engine(model_dir)
    pub = DirectoryPublisher(tmp_path / "weights", model_dir)
    run_stage(engine, ListBatchSource(_trajs(2)), pub, StageSettings(kind="sft", max_steps=1, batch_size=2))
    assert list(iter_versions(pub)) == [1]
    hf = AutoModelForCausalLM.from_pretrained(str(pub.path(1)), dtype=torch.float32)
    tokens = _trajs(1, seed=5)[0].tokens
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([tokens])).logits, -1)[0, :-1].gather(-1, torch.tensor(tokens[1:])[:, None])[:, 0]
    ours = torch.tensor(engine.logprobs([tokens])[0][1:])
    assert (ours - ref).abs().max().item() <= 1e-5


def test_in_memory_publisher_rejects_old_versions() -> None:
    pub = InMemoryPublisher()
    pub.publish(2, [("w", torch.zeros(1))])
    with pytest.raises(ValueError, match="not newer"):
        pub.publish(2, [("w", torch.zeros(1))])
