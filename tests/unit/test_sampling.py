"""`sample_token`: the log-prob recorded is of the raw distribution, or with `tempered` of the
tempered one it was drawn from; greedy requests keep the raw one either way."""
from __future__ import annotations

import torch

from kiln.services.rollout.engine import SamplingOptions
from kiln.services.rollout.sampling import sample_token


def test_recorded_logprob_is_of_the_distribution_sampled_from() -> None:
    logits = torch.randn(50, generator=torch.Generator().manual_seed(0)) * 3
    hot = SamplingOptions(temperature=2.0)
    for seed in range(5):
        token, raw = sample_token(logits, hot, torch.Generator().manual_seed(seed))
        again, tempered = sample_token(logits, hot, torch.Generator().manual_seed(seed), tempered=True)
        assert again == token  # the same draw: only what is recorded differs
        assert raw == float(torch.log_softmax(logits, -1)[token])
        assert tempered == float(torch.log_softmax(logits / 2.0, -1)[token])
        assert abs(tempered - raw) > 1e-3
    token, logp = sample_token(logits, SamplingOptions(temperature=0.0), torch.Generator(), tempered=True)
    assert token == int(logits.argmax()) and logp == float(torch.log_softmax(logits, -1)[token])
    # Temperature 1 is the raw distribution whichever way it is recorded.
    gen = torch.Generator().manual_seed(1)
    token, logp = sample_token(logits, SamplingOptions(temperature=1.0), gen, tempered=True)
    assert logp == float(torch.log_softmax(logits, -1)[token])
