"""``build_engine_config``: engine arguments it does not know are refused before anything loads.

Proves: the message names each unknown argument and lists every known one, so a misspelt
argument (``max_num_seq``) shows its right spelling; each known argument reaches its field of the
engine config (``--scheduling-policy`` through the CLI too, offering every policy the config
knows); a tensor-parallel size that does not divide the model's heads is refused with the
model's name before any rank starts; ``hf_overrides`` replaces config.json fields (nested
objects merged), reaches the built model, and an override of a field pieceworks does not implement
is refused naming it.
Run: pytest tests/engine/test_arg_utils.py
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pieceworks.engine.arg_utils import EngineArgs, build_engine_config


def test_an_unknown_engine_argument_is_refused_with_every_known_one():
    known = sorted(field.name for field in dataclasses.fields(EngineArgs))
    with pytest.raises(TypeError) as error:
        build_engine_config("llama-tiny", None, max_num_seq=4, dtyp="float32")
    assert str(error.value) == f"unknown engine argument(s) ['dtyp', 'max_num_seq']; known: {known}"
    assert "max_num_seqs" in known and "dtype" in known


def test_each_engine_argument_reaches_its_config_field():
    config = build_engine_config(
        "llama-tiny",
        None,
        dtype="float32",
        max_model_len=64,
        max_num_seqs=3,
        max_num_batched_tokens=32,
        seed=5,
        block_size=8,
        gpu_memory_utilization=0.5,
        num_gpu_blocks_override=7,
        kv_cache_memory_bytes=1 << 20,
        tokenizer="tokenizer-dir",
        async_scheduling=False,
        num_scheduler_steps=2,
        scheduling_policy="priority",
    )
    model, cache, scheduler = config.model_config, config.cache_config, config.scheduler_config
    assert (model.dtype, model.max_model_len, model.seed) == (torch.float32, 64, 5)
    assert model.tokenizer == "tokenizer-dir"
    assert (cache.block_size, cache.gpu_memory_utilization) == (8, 0.5)
    assert (cache.num_gpu_blocks_override, cache.kv_cache_memory_bytes) == (7, 1 << 20)
    assert (scheduler.max_num_seqs, scheduler.max_num_batched_tokens) == (3, 32)
    assert (scheduler.async_scheduling, scheduler.num_scheduler_steps) == (False, 2)
    assert scheduler.policy == "priority"


def test_the_scheduling_policy_flag_offers_every_policy_and_reaches_the_engine_args():
    import argparse

    from pieceworks.config import SCHEDULING_POLICIES
    from pieceworks.entrypoints.engine_args import add_engine_args, engine_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser, "llama-tiny")
    choices = next(a.choices for a in parser._actions if a.dest == "scheduling_policy")
    assert tuple(choices) == SCHEDULING_POLICIES
    args = parser.parse_args(["--scheduling-policy", "priority"])
    assert engine_args(args)["scheduling_policy"] == "priority"
    assert "scheduling_policy" not in engine_args(parser.parse_args([]))


def test_a_tensor_parallel_size_that_does_not_divide_the_heads_is_refused():
    from pieceworks.models.loading.config_checks import ModelConfigError

    with pytest.raises(ModelConfigError) as error:
        build_engine_config("llama-tiny", None, tensor_parallel_size=3)
    assert str(error.value) == (
        "preset 'llama-tiny': num_attention_heads=4 is not divisible by tensor_parallel_size=3; "
        "pick a tensor_parallel_size that divides it"
    )


def test_hf_overrides_replace_config_fields_and_reach_the_model():
    from pieceworks.engine.llm import LLM

    base = build_engine_config("llama-tiny", None).model_config.hf_config
    assert base["tie_word_embeddings"] is True
    config = build_engine_config(
        "llama-tiny",
        None,
        hf_overrides='{"tie_word_embeddings": false, "rope_scaling": {"rope_type": "default"}}',
    )
    assert config.model_config.hf_config["tie_word_embeddings"] is False
    assert config.model_config.hf_config["rope_scaling"] == {"rope_type": "default"}
    assert config.compute_hash() != build_engine_config("llama-tiny", None).compute_hash()
    llm = LLM("llama-tiny", enforce_eager=True, hf_overrides={"num_hidden_layers": 1})
    try:
        names = [name for name, _ in llm.engine.runner.model.named_parameters()]
        assert any(".layers.0." in name for name in names)
        assert not any(".layers.1." in name for name in names)
        assert llm.generate([{"prompt_token_ids": [1, 2, 3]}])[0].outputs[0].token_ids
    finally:
        llm.shutdown()


def test_hf_overrides_merge_nested_objects_and_are_checked_as_the_config_is():
    from pieceworks.engine.arg_utils import apply_hf_overrides
    from pieceworks.models.loading.config_checks import ModelConfigError

    merged = apply_hf_overrides({"a": {"x": 1, "y": 2}, "b": 1}, {"a": {"y": 3}, "c": [1]})
    assert merged == {"a": {"x": 1, "y": 3}, "b": 1, "c": [1]}
    with pytest.raises(
        ModelConfigError, match="with hf_overrides: rope type .yarn. is not supported"
    ):
        build_engine_config(
            "llama-tiny", None, hf_overrides={"rope_scaling": {"rope_type": "yarn"}}
        )
    with pytest.raises(ValueError, match="not valid JSON"):
        build_engine_config("llama-tiny", None, hf_overrides="{tie_word_embeddings: false}")
    with pytest.raises(ValueError, match="an object of config.json fields, not list"):
        build_engine_config("llama-tiny", None, hf_overrides=[1])
