"""``speculative_config`` is read as vLLM's dict or JSON, and what is not implemented is refused.

Proves: the JSON text of ``--speculative-config`` and the dict give the same config; one lookup
bound sets the other and neither gives vLLM's default; unknown keys, unknown methods,
``draft_model`` without a model or with n-gram bounds, a missing ``num_speculative_tokens``,
bad bounds, ``num_scheduler_steps > 1`` and a hybrid (recurrent-state) model are refused with a
message naming them; n-gram speculation keeps async scheduling and a draft model turns it off;
the CLI flag reaches the engine arguments.

Run: ``PIECEWORKS_PLATFORM=cpu pytest tests/test_speculative_config.py -q``
"""

from __future__ import annotations

import argparse

import pytest

from pieceworks.engine.arg_utils import build_engine_config
from pieceworks.entrypoints.engine_args import add_engine_args, engine_args
from pieceworks.speculative_config import SpeculativeConfig

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}


def test_json_and_dict_give_the_same_config():
    config = build_engine_config("llama-tiny", speculative_config=NGRAM)
    assert config.speculative_config == SpeculativeConfig.from_fields(
        '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}'
    )
    assert config.speculative_config.prompt_lookup_min == 4  # one bound sets the other
    assert config.scheduler_config.async_scheduling  # syncs only where a proposal needs one
    draft = {"method": "draft_model", "model": "llama-tiny", "num_speculative_tokens": 2}
    config = build_engine_config("llama-tiny", speculative_config=draft)
    assert not config.scheduler_config.async_scheduling  # the draft follows every step
    default = SpeculativeConfig(num_speculative_tokens=2)
    assert (default.prompt_lookup_min, default.prompt_lookup_max) == (5, 5)
    assert build_engine_config("llama-tiny").speculative_config is None


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({**NGRAM, "lookahead": 2}, r"unknown key\(s\) \['lookahead'\]"),
        ({"method": "eagle", "num_speculative_tokens": 2}, "method 'eagle' is unknown"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "needs 'model'"),
        (
            {
                "method": "draft_model",
                "model": "x",
                "num_speculative_tokens": 2,
                "prompt_lookup_max": 3,
            },  # fmt: skip
            "apply to the 'ngram' method",
        ),
        ({"model": "x", "num_speculative_tokens": 2}, "'model' is for the 'draft_model'"),
        ({"method": "ngram"}, "needs num_speculative_tokens"),
        ({"num_speculative_tokens": 0}, "num_speculative_tokens=0"),
        ({"num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "above"),
        ("{not json", "not valid JSON"),
    ],
)
def test_bad_fields_are_refused_by_name(fields, message):
    with pytest.raises(ValueError, match=message):
        build_engine_config("llama-tiny", speculative_config=fields)


def test_combinations_not_implemented_are_refused_by_name():
    with pytest.raises(ValueError, match="num_scheduler_steps=4"):
        build_engine_config("llama-tiny", speculative_config=NGRAM, num_scheduler_steps=4)
    with pytest.raises(ValueError, match="hybrid \\(recurrent-state\\)"):
        build_engine_config("bamba-tiny", speculative_config=NGRAM)


def test_the_cli_flag_reaches_the_engine_arguments():
    parser = argparse.ArgumentParser()
    add_engine_args(parser, "llama-tiny")
    args = parser.parse_args(["--speculative-config", '{"num_speculative_tokens": 2}'])
    assert engine_args(args)["speculative_config"] == '{"num_speculative_tokens": 2}'
