"""``SamplingParams``' text fields: vLLM's forms are accepted and normalised, bad values are
rejected with a message naming the field; stop token id 0 is a valid id; each of ``n``
completions gets ``n=1`` and its own seed.

Run: ``pytest tests/engine/test_sampling_params.py -q``.
"""

from __future__ import annotations

import pytest

from pieceworks.engine.output_processor import _completion_params
from pieceworks.engine.sampling_params import SamplingParams


def test_stop_token_id_zero_is_accepted():
    assert 0 in SamplingParams(stop_token_ids=[0]).stop_token_ids  # token 0 is a valid id


def test_stop_string_or_list_becomes_a_tuple():
    assert SamplingParams(stop="\n").stop == ("\n",)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    assert SamplingParams().stop == () and SamplingParams().skip_special_tokens
    hash(SamplingParams(stop=["a"]))  # frozen and hashable, as before


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"stop": [""]}, "stop"),
        ({"stop": [3]}, "stop"),
        ({"n": 0}, "n="),
        ({"n": 1.5}, "n="),
        ({"logprobs": -1}, "logprobs="),
        ({"logprobs": True}, "logprobs="),
        ({"prompt_logprobs": "5"}, "prompt_logprobs="),
        ({"skip_special_tokens": "no"}, "skip_special_tokens="),
    ],
)
def test_bad_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_completion_params_of_n():
    params = SamplingParams(n=3, seed=7, prompt_logprobs=2, temperature=0.8)
    children = [_completion_params(params, index) for index in range(3)]
    assert [c.seed for c in children] == [7, 8, 9] and all(c.n == 1 for c in children)
    assert [c.prompt_logprobs for c in children] == [2, None, None]
    unseeded = _completion_params(SamplingParams(n=2), 1)
    assert unseeded.seed is None
    assert _completion_params(SamplingParams(n=2, seed=3), 1) == SamplingParams(seed=4)
    assert _completion_params(SamplingParams(), 0) == SamplingParams()


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"temperature": "0.5"}, "temperature='0.5' must be a number"),
        ({"top_p": None}, "top_p=None must be a number"),
        ({"temperature": True}, "temperature=True must be a number"),
        ({"stop_token_ids": [True]}, r"stop_token_ids must be non-negative integers; got \[True\]"),
    ],
)
def test_values_of_the_wrong_type_are_refused_with_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**fields)
