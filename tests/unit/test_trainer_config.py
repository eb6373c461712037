"""Trainer configuration derived from an RLJob: the stage's `rl.loss` reaches the trainer as it
is, and the loss computed from it is the number the mirrored config gave."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kiln.api.loss import PPOLoss
from kiln.api.spec import RLJob
from kiln.services.trainer.config import config_from_job
from kiln.services.trainer.loss import policy_loss


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
                 "microBatchSize": 2, "rl": {"loss": {"mode": "ppo", "epsLow": 0.1, "epsHigh": 0.3,
                                                      "icepopBeta": 3.0, "aggregation": "sequence-mean"},
                                             "minibatches": 2, "resetOptimizerOnSync": False}},
            ],
            "trainer": {"checkpointInterval": 7, "keepCheckpoints": 4, "gradClip": 0.5, **trainer},
            "seed": 3,
        },
    })


def test_rl_stage_settings_reach_the_trainer(tmp_path: Path) -> None:
    cfg = config_from_job(_job(), run_dir=tmp_path, stage="rl")
    assert cfg.model_dir == Path("models/m") and cfg.params_dtype == "float32" and cfg.seed == 3
    # The stage's loss as the job wrote it, not a copy under other names.
    assert cfg.loss == PPOLoss(mode="ppo", eps_low=0.1, eps_high=0.3, icepop_beta=3.0, aggregation="sequence-mean")
    assert cfg.loss == _job().spec.stages[1].rl.loss and cfg.minibatches_per_step == 2
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
    assert cfg.terms.task_reward_weight == 0.25 and cfg.routing_replay == "record"
    assert cfg.terms.sampled_weight == 0.5
    assert config_from_job(job, run_dir=tmp_path, stage="rl").routing_replay == "replay"
    data["spec"]["stages"][1]["rl"].update(advantage="group", teacher=None, taskRewardWeight=0.0,
                                           sampledWeight=1.0,
                                           advantageNorm="mean-std", loss={"aggregation": "sequence-sum"})
    data["spec"]["rollout"] = {"sampling": {"maxTotalTokens": 300}}
    cfg = config_from_job(RLJob.model_validate(data), run_dir=tmp_path, stage="rl")
    assert (cfg.terms.advantage_norm, cfg.loss.mode, cfg.loss.aggregation, cfg.terms.seq_sum_tokens) == (
        "mean-std", "masked", "sequence-sum", 300)
    assert cfg.terms.correction is None and cfg.terms.kl_clamp == 10.0
    data["spec"]["stages"][1]["rl"].update(correction={"level": "geometric", "mode": "mask", "upper": 1.5})
    cfg = config_from_job(RLJob.model_validate(data), run_dir=tmp_path, stage="rl")
    assert (cfg.terms.correction.level, cfg.terms.correction.upper) == ("geometric", 1.5)


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
    assert config_from_job(job, run_dir=tmp_path, stage="rl").terms.temperature == trained_at
    assert config_from_job(job, run_dir=tmp_path, stage="warm").terms.temperature == 1.0  # sft
    assert EngineSettings.from_job(job).tempered_logprobs is engine_tempered
    assert EngineSettings.from_job(job, tempered_logprobs=False).tempered_logprobs is False  # teachers


# policy_loss on one fixed batch under the old trainer-side `PolicyLossConfig` (the mirrored
# fields, before `rl.loss`): masked eps 0.1/0.3; ppo eps 0.1/0.3, dualClip 3, IcePop 1.5,
# seq_mean; masked seq_sum over 300 tokens. The same numbers must come from `rl.loss` as is.
BEFORE = {"masked": 0.07173145076043157, "ppo": -0.12884497007545467, "masked-sum": -8.89236943790117e-05}
LOSSES = {"masked": {"mode": "masked", "epsLow": 0.1, "epsHigh": 0.3},
          "ppo": {"mode": "ppo", "epsLow": 0.1, "epsHigh": 0.3, "dualClip": 3.0, "icepopBeta": 1.5,
                  "aggregation": "sequence-mean"},
          "masked-sum": {"aggregation": "sequence-sum"}}


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_the_loss_from_a_job_gives_the_numbers_the_mirrored_config_gave(tmp_path: Path, name: str) -> None:
    data = _job().model_dump(by_alias=True)
    data["spec"]["stages"][1]["rl"]["loss"] = LOSSES[name]
    data["spec"]["rollout"] = {"sampling": {"maxTotalTokens": 300}}
    cfg = config_from_job(RLJob.model_validate(data), run_dir=tmp_path, stage="rl")
    g = torch.Generator().manual_seed(7)
    infer = -torch.rand(3, 8, generator=g, dtype=torch.float64) * 2
    old = infer + torch.randn(3, 8, generator=g, dtype=torch.float64) * 0.3
    logp = old + torch.randn(3, 8, generator=g, dtype=torch.float64) * 0.3
    mask = (torch.rand(3, 8, generator=g) > 0.25).to(torch.float64)
    adv = torch.randn(3, generator=g, dtype=torch.float64)
    loss, _ = policy_loss(logp, infer, mask, adv, cfg.loss, logp_train_old=old,
                          seq_sum_tokens=cfg.terms.seq_sum_tokens)
    assert loss.item() == pytest.approx(BEFORE[name], rel=1e-12)


def test_a_stage_start_hands_the_engine_that_stage_s_loss_terms_and_minibatches(tmp_path: Path) -> None:
    """The engine starts with one stage's config; each stage start swaps in its own (the warm
    SFT stage takes 1 minibatch and the default loss, the ppo stage 2 and its rl.loss)."""
    import threading
    from types import SimpleNamespace

    from kiln.services.trainer.stages import StageRunner

    job = _job()
    engine = SimpleNamespace(config=config_from_job(job, run_dir=tmp_path, stage="warm"),
                             optimizer=SimpleNamespace(param_groups=[{}]), scheduler=SimpleNamespace(),
                             stage=None, stage_steps={}, last_metrics=None)
    runner = StageRunner(job, engine, threading.Lock(), None, None, tmp_path)
    runner._configure(job.spec.stages[1])
    want = config_from_job(job, run_dir=tmp_path, stage="rl")
    assert (engine.config.loss, engine.config.terms, engine.config.minibatches_per_step) == (
        want.loss, want.terms, 2)
