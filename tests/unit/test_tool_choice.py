"""Tool choices (`rollout.sampling.toolChoiceTemperature`): the token after a call's opening is
sampled at its own temperature among the tools' first tokens, its log-prob recorded under that
distribution, and the trainer computes the same log-prob there (and nowhere else differently),
with gradients that reach only the tools' logits. The engine is the real torch engine and the
trainer's model the real Megatron one, from the same checkpoint."""
from __future__ import annotations

import asyncio

import pytest
import torch
from pydantic import ValidationError

from kiln.api.spec import RLJob
from kiln.models import parallel
from kiln.models.hf_io import load_hf_checkpoint
from kiln.models.megatron_model import ToolChoices, choice_logits, token_logprobs
from kiln.models.tiny import make_tiny_checkpoint
from kiln.services.rollout.engine import EngineSettings, SamplingOptions, ToolChoiceRule
from kiln.services.rollout.sampling import sample_token
from kiln.services.rollout.torch_engine import TorchEngine
from kiln.services.trainer.batch import collate
from kiln.services.trainer.replay import batch_logprobs
from kiln.trajectory import ToolChoice, Trajectory, spans_from_versions

# After (7, 8) one of 3, 11, 20 at 4; after (7, 8, 3) one of 4, 5 at 0.5 (an argument's values).
RULE = ToolChoiceRule(choices=(((7, 8), (3, 11, 20), 4.0), ((7, 8, 3), (4, 5), 0.5)))


def test_a_rule_applies_right_after_its_openings():
    assert RULE.allowed([1, 7, 8]) == RULE.allowed([7, 8]) == ((3, 11, 20), 4.0)
    assert RULE.allowed([7, 8, 3]) == ((4, 5), 0.5)  # the longest opening that matches
    assert RULE.allowed([7, 8, 3, 4]) is None and RULE.allowed([8]) is None and RULE.allowed([]) is None
    assert RULE.positions([7, 8, 3, 4, 1, 7, 8, 11, 8]) == [
        (2, (3, 11, 20), 4.0), (3, (4, 5), 0.5), (7, (3, 11, 20), 4.0)]
    # An empty opening: the reply's first token, and no other.
    first = ToolChoiceRule((((), (7, 9), 4.0),) + RULE.choices)
    assert first.allowed([]) == ((7, 9), 4.0) and first.allowed([9]) is None
    assert first.positions([7, 8, 3, 4]) == [(0, (7, 9), 4.0), (2, (3, 11, 20), 4.0), (3, (4, 5), 0.5)]


def test_a_tool_choice_is_sampled_among_the_tools_at_its_own_temperature():
    logits = torch.randn(50, generator=torch.Generator().manual_seed(0)) * 3
    logits[[3, 11, 20]] = torch.tensor([-4.0, -5.0, -6.0])  # never sampled without the rule
    hot = SamplingOptions(temperature=0.5, tool_choice=RULE)
    expected = torch.log_softmax(logits[[3, 11, 20]] / 4.0, -1)
    seen = set()
    for seed in range(60):
        token, logp = sample_token(logits, hot, torch.Generator().manual_seed(seed), True, [5, 7, 8])
        assert token in (3, 11, 20)
        assert logp == pytest.approx(float(expected[(3, 11, 20).index(token)]), abs=1e-6)
        seen.add(token)
    assert len(seen) == 3  # every tool gets tried
    # An argument's values at their own temperature.
    token, logp = sample_token(logits, hot, torch.Generator().manual_seed(0), True, [7, 8, 3])
    assert token in (4, 5)
    assert logp == pytest.approx(float(torch.log_softmax(logits[[4, 5]] / 0.5, -1)[token - 4]), abs=1e-6)
    # Elsewhere the request's own temperature; greedy requests ignore the rule.
    token, logp = sample_token(logits, hot, torch.Generator().manual_seed(0), True, [7])
    assert logp == pytest.approx(float(torch.log_softmax(logits / 0.5, -1)[token]), abs=1e-6)
    # A greedy request takes the argmax among the choice's tokens (the policy training
    # sampled from, decoded), and the plain argmax elsewhere.
    greedy = SamplingOptions(temperature=0.0, tool_choice=RULE)
    assert sample_token(logits, greedy, torch.Generator(), True, [7, 8])[0] == 3
    assert sample_token(logits, greedy, torch.Generator(), True, [7])[0] == int(logits.argmax())


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    parallel.init_parallel(1)
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "m", hidden_size=64, num_layers=2,
                                intermediate_size=128, seed=0)


@pytest.mark.parametrize("temperature", [1.0, 1.5])
def test_the_trainer_computes_the_log_probs_the_engine_recorded(checkpoint, temperature):
    async def generate():
        engine = await TorchEngine.start(EngineSettings(model=str(checkpoint), dtype="float32",
                                                        tempered_logprobs=True))
        prompt = [1, 40, 41, 42]
        # A first token drawn with a seed opens the rule; the same seed draws it again.
        first = (await engine.generate(prompt, SamplingOptions(temperature, max_tokens=1, seed=3))).token_ids
        rule = ToolChoiceRule(((tuple(first), (5, 9, 60, 61), 3.0), ((*first, 9), (2, 70), 0.7),
                               ((*first, 5), (2, 70), 0.7)))
        gen = await engine.generate(prompt, SamplingOptions(temperature, max_tokens=12, seed=3,
                                                            tool_choice=rule))
        return prompt, rule, gen

    prompt, rule, gen = asyncio.run(generate())
    chosen = rule.positions(gen.token_ids)
    positions = [len(prompt) + i for i, _, _ in chosen]
    assert positions and gen.token_ids[0] == rule.choices[0][0][0]
    n = len(prompt) + len(gen.token_ids)
    traj = Trajectory(id="t", task_id="task", group_id="g", tokens=prompt + gen.token_ids,
                      loss_mask=[0] * len(prompt) + [1] * len(gen.token_ids),
                      logp_infer=[0.0] * len(prompt) + gen.logprobs,
                      version_spans=spans_from_versions([-1] * len(prompt) + gen.versions),
                      tool_choice=ToolChoice(positions, [t for _, ids, _ in chosen for t in ids],
                                             [len(ids) for _, ids, _ in chosen],
                                             [temp for _, _, temp in chosen]))
    traj.check()
    plain = Trajectory(**{**traj.__dict__, "id": "u", "tool_choice": None})
    tb = collate([traj, plain])
    model, _ = load_hf_checkpoint(checkpoint, tp=1)
    logp = batch_logprobs(model, tb, "off", temperature=temperature)[0]
    generated = torch.arange(len(prompt), n)
    assert (logp[0, generated] - torch.tensor(gen.logprobs)).abs().max().item() < 1e-5
    # The same tokens without their choices: every other position agrees, the choices do not.
    others = [i for i in generated.tolist() if i not in positions]
    assert torch.equal(logp[1, others], logp[0, others])
    assert (logp[1, positions] - logp[0, positions]).abs().min().item() > 1e-3


def test_a_choices_gradient_reaches_only_the_tools_logits():
    logits = torch.randn(2, 5, 30, generator=torch.Generator().manual_seed(1), requires_grad=True)
    ids = torch.tensor([[4, 9, 9], [2, 3, 8]])
    # Token [0, 3] chosen among 4 and 9 at 2, token [1, 1] among 2, 3, 8 at 5.
    choices = ToolChoices(torch.tensor([0, 1]), torch.tensor([3, 1]), ids, torch.tensor([2.0, 5.0]))
    tokens = torch.tensor([[0, 1, 2, 9, 3], [0, 8, 1, 2, 3]])
    from kiln.models.megatron_model import _sampled_logprobs
    logp = _sampled_logprobs(logits, tokens, 1.5, choices)
    row = choice_logits(logits[0, 2].detach(), ids[0], 1.5 / 2.0, 1.5)
    assert float(logp[0, 3].detach()) == pytest.approx(float(torch.log_softmax(row, -1)[9]), abs=1e-6)
    logp[0, 3].backward()
    grad = logits.grad[0, 2]
    assert set(grad.nonzero()[:, 0].tolist()) == {4, 9}
    # A micro-batch of the second row alone keeps its entry, renumbered.
    part = choices.select(torch.tensor([1]), 2)
    assert part.rows.tolist() == [0] and part.cols.tolist() == [1] and part.ids.tolist() == [[2, 3, 8]]


def _job(**sampling) -> dict:
    return {"apiVersion": "kiln.dev/v1alpha1", "kind": "RLJob", "metadata": {"name": "j"},
            "spec": {"model": {"path": "m"},
                     "tasks": [{"name": "t", "env": "chain", "generate": {"count": 4}}],
                     "stages": [{"name": "rl", "type": "rl", "tasks": ["t"]}],
                     "rollout": {"toolCallFormat": "tags", "sampling": sampling}}}


def test_a_tool_choice_temperature_is_checked_with_the_job():
    job = RLJob.model_validate(_job(toolChoiceTemperature=6))
    assert job.spec.rollout.sampling.processed_logprobs
    assert EngineSettings.from_job(job).tempered_logprobs  # the engine records what it drew
    for bad, message in [({"temperature": 0}, "needs a sampling temperature above 0"),
                         ({"topP": 0.9}, "topP must be 1"),
                         ({"toolChoiceTemperature": 0}, "greater than 0")]:
        with pytest.raises(ValidationError, match=message):
            RLJob.model_validate(_job(**{"toolChoiceTemperature": 6, **bad}))
    doc = _job(toolChoiceTemperature=6)
    doc["spec"]["rollout"]["toolCallFormat"] = "hermes"
    with pytest.raises(ValidationError, match="toolChoiceTemperature needs toolCallFormat 'tags'"):
        RLJob.model_validate(doc)
    doc = _job(toolChoiceTemperature=6)
    doc["spec"]["trainer"] = {"tensorParallel": 2}
    with pytest.raises(ValidationError, match="toolChoiceTemperature needs trainer.tensorParallel 1"):
        RLJob.model_validate(doc)


def test_a_served_engine_is_never_sent_a_rule_it_would_drop():
    from kiln.services.rollout import wire
    assert wire.generate_request([1, 2], SamplingOptions()).token_ids == [1, 2]
    with pytest.raises(ValueError, match="does not carry tool choices"):
        wire.generate_request([1, 2], SamplingOptions(tool_choice=RULE))
