"""``SamplingParams``' text fields: vLLM's forms are accepted and normalised, bad values are
rejected with a message naming the field; stop token id 0 is a valid id; each of ``n``
completions gets ``n=1`` and its own seed.

Run: ``pytest tests/test_sampling_params.py -q``.
"""

from __future__ import annotations

import pytest

from pieceworks.engine.output_processor import _completion_params
from pieceworks.sampling_params import SamplingParams


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


LOGPROBS_HINT = (
    "must be None or an integer >= 0 (how many top log-probabilities to return per token; 0: "
    "only the chosen token's)"
)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"temperature": "1"}, "temperature='1' must be a number"),
        ({"temperature": True}, "temperature=True must be a number"),
        ({"top_p": None}, "top_p=None must be a number"),
        (
            {"temperature": -0.5},
            "temperature=-0.5 must be a finite number >= 0 (0 means greedy decoding)",
        ),
        (
            {"temperature": float("inf")},
            "temperature=inf must be a finite number >= 0 (0 means greedy decoding)",
        ),
        ({"top_p": 0.0}, "top_p=0.0 must be in (0, 1]; use 1.0 to disable top-p"),
        ({"top_p": 1.5}, "top_p=1.5 must be in (0, 1]; use 1.0 to disable top-p"),
        ({"top_k": -2}, "top_k=-2 must be an integer >= 1, or 0 / -1 to disable top-k"),
        ({"top_k": 2.0}, "top_k=2.0 must be an integer >= 1, or 0 / -1 to disable top-k"),
        ({"seed": 1.5}, "seed=1.5 must be an integer or None"),
        ({"max_tokens": 0}, "max_tokens=0 must be an integer >= 1"),
        ({"max_tokens": 2.0}, "max_tokens=2.0 must be an integer >= 1"),
        (
            {"stop_token_ids": [3, -1, True]},
            "stop_token_ids must be non-negative integers; got [-1, True]",
        ),
        ({"stop_token_ids": [2.0]}, "stop_token_ids must be non-negative integers; got [2.0]"),
        ({"stop": ["a", "", 3]}, "stop must be non-empty strings; got ['', 3]"),
        ({"n": 0}, "n=0 must be an integer >= 1 (completions per prompt)"),
        ({"n": True}, "n=True must be an integer >= 1 (completions per prompt)"),
        ({"n": 2.0}, "n=2.0 must be an integer >= 1 (completions per prompt)"),
        ({"logprobs": -1}, f"logprobs=-1 {LOGPROBS_HINT}"),
        ({"logprobs": True}, f"logprobs=True {LOGPROBS_HINT}"),
        ({"prompt_logprobs": 1.0}, f"prompt_logprobs=1.0 {LOGPROBS_HINT}"),
        ({"skip_special_tokens": 1}, "skip_special_tokens=1 must be a bool"),
    ],
)
def test_every_refusal_message_in_full(fields, message):
    with pytest.raises(ValueError) as error:
        SamplingParams(**fields)
    assert str(error.value) == message


def test_the_edges_of_each_range_are_accepted_and_the_properties_follow():
    edge = SamplingParams(
        temperature=0.0, top_p=1.0, top_k=-1, max_tokens=1, seed=0, n=1, logprobs=0,
        prompt_logprobs=0, skip_special_tokens=False, stop_token_ids=[0, 5],
    )  # fmt: skip
    assert edge.is_greedy and not edge.uses_top_k and not edge.uses_top_p
    assert edge.stop_token_ids == (0, 5)
    assert SamplingParams(temperature=1e-6).is_greedy
    assert not SamplingParams(temperature=1e-5).is_greedy
    assert SamplingParams(top_k=1).uses_top_k and not SamplingParams(top_k=0).uses_top_k
    assert SamplingParams(top_p=0.999).uses_top_p
    assert SamplingParams(top_p=1e-9).top_p == 1e-9
    assert SamplingParams(temperature=3).temperature == 3
    defaults = SamplingParams()
    assert (defaults.temperature, defaults.top_p, defaults.top_k, defaults.max_tokens) == (
        1.0, 1.0, 0, 16,
    )  # fmt: skip
    assert (defaults.seed, defaults.stop_token_ids, defaults.stop, defaults.n) == (None, (), (), 1)
    assert (defaults.logprobs, defaults.prompt_logprobs, defaults.skip_special_tokens) == (
        None, None, True,
    )  # fmt: skip
    assert defaults.ignore_eos is False
