"""``apply_logit_bias``: only the biased rows' tokens move, into a copy; the sampler obeys it.

Proves: a batch without a bias gets its logits back untouched (the same tensor, nothing run); a
bias is added to its row's tokens alone, in a new tensor, so the raw logits the runner turns into
log-probabilities keep their values; greedy and random rows of ``Sampler.sample`` pick a token
forced by +100 and never one banned by -100.
Run: ``PIECEWORKS_PLATFORM=cpu pytest tests/worker/test_logit_bias.py -q``
"""

from __future__ import annotations

import torch

from pieceworks.sampling_params import SamplingParams
from pieceworks.worker.logit_bias import apply_logit_bias, has_logit_bias
from pieceworks.worker.sampler import Sampler


def test_no_bias_returns_the_same_tensor():
    logits = torch.randn(2, 8)
    params = [SamplingParams(), SamplingParams(logit_bias={})]
    assert not has_logit_bias(params)
    assert apply_logit_bias(logits, params) is logits


def test_bias_moves_only_its_rows_tokens_in_a_copy():
    logits = torch.zeros(3, 8)
    params = [SamplingParams(), SamplingParams(logit_bias={2: 5.0, 7: -100}), SamplingParams()]
    biased = apply_logit_bias(logits, params)
    expected = torch.zeros(3, 8)
    expected[1, 2], expected[1, 7] = 5.0, -100.0
    assert torch.equal(biased, expected)
    assert torch.equal(logits, torch.zeros(3, 8))  # the raw logits are untouched


def test_sampler_obeys_forced_and_banned_tokens():
    logits = torch.randn(4, 64, generator=torch.Generator().manual_seed(0))
    top = int(logits[0].argmax())
    params = [
        SamplingParams(temperature=0.0, logit_bias={top: -100}),
        SamplingParams(temperature=0.0, logit_bias={5: 100}),
        SamplingParams(temperature=1.0, seed=1, logit_bias={9: 100}),
        SamplingParams(temperature=0.0),
    ]
    generators = [None, None, torch.Generator().manual_seed(1), None]
    token_ids = Sampler().sample(logits, params, generators).tolist()
    assert token_ids[0] != top
    assert token_ids[1:3] == [5, 9]
    assert token_ids[3] == int(logits[3].argmax())
