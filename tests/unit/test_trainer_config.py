"""Trainer configuration derived from an RLJob."""
from __future__ import annotations

from pathlib import Path

import pytest

from kiln.api.spec import RLJob
from kiln.services.trainer.config import config_from_job


def _job(**trainer) -> RLJob:
    return RLJob.model_validate({
        "apiVersion": "kiln.dev/v1alpha1", "kind": "RLJob", "metadata": {"name": "t"},
        "spec": {
            "model": {"path": "models/m", "dtype": "float32"},
            "tasks": [{"name": "c", "env": "chain", "generate": {"count": 4}}],
            "stages": [
                {"name": "warm", "type": "sft", "tasks": ["c"], "learningRate": 1e-3, "batchSize": 8,
                 "microBatchSize": 4},
                {"name": "rl", "type": "rl", "tasks": ["c"], "learningRate": 5e-4, "batchSize": 8,
                 "microBatchSize": 2, "rl": {"epsLow": 0.1, "epsHigh": 0.3, "icepopBeta": 3.0,
                                             "lossMode": "ppo", "minibatches": 2,
                                             "resetOptimizerOnSync": False,
                                             "lossAggregation": "sequence-mean"}},
            ],
            "trainer": {"checkpointInterval": 7, "keepCheckpoints": 4, "gradClip": 0.5, **trainer},
            "seed": 3,
        },
    })


def test_rl_stage_settings_reach_the_trainer(tmp_path: Path) -> None:
    cfg = config_from_job(_job(), run_dir=tmp_path, stage="rl")
    assert cfg.model_dir == Path("models/m") and cfg.params_dtype == "float32" and cfg.seed == 3
    assert (cfg.loss.eps_low, cfg.loss.eps_high, cfg.loss.icepop_beta, cfg.loss.aggregation) == (0.1, 0.3, 3.0, "seq_mean")
    assert (cfg.loss.mode, cfg.loss.dual_clip, cfg.minibatches_per_step) == ("ppo", None, 2)
    assert cfg.optimizer.lr == 5e-4 and cfg.optimizer.grad_clip == 0.5
    assert cfg.optimizer.reset_moments_on_publish is False
    assert cfg.optimizer.betas == (0.9, 0.95)  # the spec's default
    assert cfg.micro_batch_size == 2
    assert (cfg.checkpoint_dir, cfg.checkpoint_interval, cfg.keep_checkpoints) == (tmp_path / "checkpoints", 7, 4)


def test_distillation_and_routing_settings_reach_the_trainer(tmp_path: Path) -> None:
    job = _job()
    data = job.model_dump(by_alias=True)
    data["spec"]["stages"][1]["rl"].update(advantage="opd", teacher="warm", taskRewardWeight=0.25,
                                           sampledWeight=0.5)
    data["spec"]["model"]["routingReplay"] = "record"
    cfg = config_from_job(RLJob.model_validate(data), run_dir=tmp_path, stage="rl")
    assert cfg.loss.task_reward_weight == 0.25 and cfg.routing_replay == "record"
    assert cfg.loss.sampled_weight == 0.5
    assert config_from_job(job, run_dir=tmp_path, stage="rl").routing_replay == "replay"
    data["spec"]["stages"][1]["rl"].update(advantage="group", teacher=None, taskRewardWeight=0.0,
                                           sampledWeight=1.0,
                                           advantageNorm="mean-std", lossAggregation="sequence-sum")
    data["spec"]["rollout"] = {"sampling": {"maxTotalTokens": 300}}
    cfg = config_from_job(RLJob.model_validate(data), run_dir=tmp_path, stage="rl")
    assert (cfg.loss.advantage_norm, cfg.loss.aggregation, cfg.loss.seq_sum_tokens) == ("mean-std", "seq_sum", 300)


def test_default_stage_is_the_first(tmp_path: Path) -> None:
    cfg = config_from_job(_job(), run_dir=tmp_path, model_dir=tmp_path / "other")
    assert cfg.optimizer.lr == 1e-3 and cfg.micro_batch_size == 4 and cfg.model_dir == tmp_path / "other"


def test_unknown_stage_and_unsupported_parallelism_are_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="stage 'nope'"):
        config_from_job(_job(), run_dir=tmp_path, stage="nope")
    with pytest.raises(ValueError, match="pipelineParallel"):
        config_from_job(_job(pipelineParallel=2), run_dir=tmp_path)


def test_adam_betas_come_from_the_trainer_spec(tmp_path: Path) -> None:
    cfg = config_from_job(_job(adamBeta1=0.8, adamBeta2=0.99), run_dir=tmp_path)
    assert cfg.optimizer.betas == (0.8, 0.99)
    with pytest.raises(ValueError, match="adamBeta2"):
        _job(adamBeta2=1.0)


@pytest.mark.parametrize("temperature, trained_at, engine_tempered", [(0.0, 1.0, False), (1.0, 1.0, False),
                                                                       (1.5, 1.5, True)])
def test_the_sampling_temperature_reaches_the_rl_loss_and_the_engine(tmp_path: Path, temperature,
                                                                    trained_at, engine_tempered) -> None:
    from kiln.services.rollout.engine import EngineSettings

    data = _job().model_dump(by_alias=True)
    data["spec"]["rollout"] = {"sampling": {"temperature": temperature}}
    job = RLJob.model_validate(data)
    assert config_from_job(job, run_dir=tmp_path, stage="rl").loss.temperature == trained_at
    assert config_from_job(job, run_dir=tmp_path, stage="warm").loss.temperature == 1.0  # sft
    assert EngineSettings.from_job(job).tempered_logprobs is engine_tempered
    assert EngineSettings.from_job(job, tempered_logprobs=False).tempered_logprobs is False  # teachers
