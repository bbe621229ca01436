"""Request fields to engine inputs: default ``max_tokens``, prompt checks, ``SamplingParams``.

Proves: a request without ``max_tokens`` gets the rest of the context, bounded by the KV cache;
``max_tokens`` <= 0, empty prompts, ids outside the vocabulary and prompts too long are 400s that
say why; choice ``i`` of a seeded request samples with ``seed + i``; sampling values the engine
refuses come back as 400 with its reason.
Run: pytest tests/entrypoints/test_serve_validation.py
"""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")

from pieceworks.entrypoints.serve.errors import APIError  # noqa: E402
from pieceworks.entrypoints.serve.protocol import CompletionRequest  # noqa: E402
from pieceworks.entrypoints.serve.validation import (  # noqa: E402
    ModelLimits,
    check_prompt,
    resolve_max_tokens,
    sampling_params,
)

LIMITS = ModelLimits(max_model_len=100, vocab_size=50, max_kv_tokens=64)


def test_default_max_tokens_is_what_is_left():
    assert resolve_max_tokens(None, 10, ModelLimits(100, 50)) == 90
    assert resolve_max_tokens(None, 10, LIMITS) == 55  # 64 KV tokens: 10 + 55 - 1 fit
    assert resolve_max_tokens(7, 10, LIMITS) == 7
    with pytest.raises(APIError, match="max_tokens=0 must be at least 1"):
        resolve_max_tokens(0, 10, LIMITS)


@pytest.mark.parametrize(
    "prompt, max_tokens, reason",
    [
        ([], 1, "the prompt is empty"),
        ([1, 50], 1, r"token id 50 at position 1 is outside this model's vocabulary \[0, 50\)"),
        ([1, 2.0], 1, "token ids must be ints; position 1 holds 2.0"),
        ([1] * 90, 11, "maximum context length is 100"),
    ],
)
def test_bad_prompts(prompt, max_tokens, reason):
    with pytest.raises(APIError, match=reason) as error:
        check_prompt(prompt, max_tokens, LIMITS)
    assert error.value.status_code == 400


def test_sampling_params_per_choice():
    body = CompletionRequest(prompt=[1], seed=5, temperature=0.5, top_p=0.9, top_k=3, n=2)
    params = [sampling_params(body, 8, index) for index in range(2)]
    assert [p.seed for p in params] == [5, 6]
    assert params[0].temperature == 0.5 and params[0].top_p == 0.9 and params[0].top_k == 3
    assert params[0].max_tokens == 8
    defaults = sampling_params(CompletionRequest(prompt=[1]), 4)
    assert defaults.temperature == 1.0 and defaults.top_p == 1.0 and defaults.seed is None


def test_penalties_are_refused():
    with pytest.raises(APIError, match="not supported"):
        sampling_params(CompletionRequest(prompt=[1], frequency_penalty=0.5), 4)
