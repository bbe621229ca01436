"""The engine and sampling flags every subcommand shares, and their translation.

Proves: each engine flag reaches ``LLM``'s keyword arguments under vLLM's name, and an unset one
is left out; ``--enforce-eager``, ``--no-async-scheduling`` and ``--no-enable-prefix-caching``
appear only when given, and the last one turns ``CacheConfig.enable_prefix_caching`` off; ``-O`` and
``--compilation-config`` become ``CompilationConfig`` fields (``-O`` wins), and JSON that is not an
object is refused naming the flag; the sampling flags give ``SamplingParams`` (greedy by default);
the help text says what each documented flag does.
Run: pytest tests/entrypoints/test_engine_args.py
"""

from __future__ import annotations

import argparse

import pytest

from pieceworks import envs
from pieceworks.entrypoints import engine_args as ea


def parser(default_model: str | None = "llama-tiny") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pieceworks")
    ea.add_engine_args(p, default_model)
    ea.add_sampling_args(p, max_tokens=7)
    return p


def test_unset_flags_give_no_engine_arguments():
    args = parser().parse_args([])
    assert args.model == "llama-tiny"
    assert args.dtype == "auto" and args.level is None and args.compilation_config is None
    assert args.enforce_eager is False and args.async_scheduling is True
    assert args.enable_prefix_caching is True
    assert ea.engine_args(args) == {"dtype": "auto"}
    assert ea.compilation_fields(args) == {}
    assert parser(None).parse_args([]).model is None


def test_every_engine_flag_reaches_the_engine_under_its_name():
    argv = [
        "--model", "m", "--dtype", "float32", "--max-model-len", "64", "--max-num-seqs", "3",
        "--max-num-batched-tokens", "128", "--block-size", "8",
        "--gpu-memory-utilization", "0.5", "--num-gpu-blocks-override", "9",
        "--kv-cache-memory-bytes", "1000", "--quantization", "fp8",
        "--tensor-parallel-size", "2", "--seed", "4", "--num-scheduler-steps", "5",
        "--scheduling-policy", "priority", "--enforce-eager", "--no-async-scheduling",
        "--no-enable-prefix-caching", "--tokenizer", "tok",
        "--hf-overrides", '{"tie_word_embeddings": false}',
    ]  # fmt: skip
    args = parser().parse_args(argv)
    assert ea.engine_args(args) == {
        "dtype": "float32",
        "max_model_len": 64,
        "max_num_seqs": 3,
        "max_num_batched_tokens": 128,
        "block_size": 8,
        "gpu_memory_utilization": 0.5,
        "num_gpu_blocks_override": 9,
        "kv_cache_memory_bytes": 1000,
        "quantization": "fp8",
        "tensor_parallel_size": 2,
        "seed": 4,
        "num_scheduler_steps": 5,
        "scheduling_policy": "priority",
        "enforce_eager": True,
        "async_scheduling": False,
        "enable_prefix_caching": False,
        "tokenizer": "tok",
        "hf_overrides": '{"tie_word_embeddings": false}',
    }


def test_no_enable_prefix_caching_turns_the_cache_config_field_off():
    from pieceworks.engine.arg_utils import build_engine_config

    args = parser().parse_args(["--no-enable-prefix-caching"])
    config = build_engine_config("llama-tiny", **ea.engine_args(args))
    assert config.cache_config.enable_prefix_caching is False
    assert build_engine_config("llama-tiny").cache_config.enable_prefix_caching is True


@pytest.mark.parametrize("flag, value", [("-O", "4"), ("--dtype", "int8")])
def test_values_outside_the_choices_are_refused(flag, value, capsys):
    with pytest.raises(SystemExit):
        parser().parse_args([flag, value])
    assert "invalid choice" in capsys.readouterr().err


def test_level_and_compilation_config_become_compilation_fields():
    args = parser().parse_args(["--compilation-config", '{"level": 1, "cudagraph_mode": "NONE"}'])
    assert ea.compilation_fields(args) == {"level": 1, "cudagraph_mode": "NONE"}
    args = parser().parse_args(["-O", "3", "--compilation-config", '{"level": 1}'])
    assert ea.compilation_fields(args) == {"level": 3}
    assert ea.compilation_fields(parser().parse_args(["-O", "0"])) == {"level": 0}


def test_compilation_config_that_is_not_a_json_object_is_refused():
    with pytest.raises(ValueError) as error:
        ea.compilation_config_json("{level: 3")
    message = str(error.value)
    assert message.startswith("--compilation-config '{level: 3' is not valid JSON (")
    assert """pass an object such as '{"level": 3, "cudagraph_mode": "PIECEWISE"}'""" in message
    with pytest.raises(ValueError) as error:
        ea.compilation_config_json("[3]")
    assert str(error.value) == (
        "--compilation-config '[3]' is a JSON list, not an object of CompilationConfig fields; "
        """pass an object such as '{"level": 3, "cudagraph_mode": "PIECEWISE"}'"""
    )
    assert ea.compilation_config_json("{}") == {}


def test_default_models(monkeypatch):
    assert ea.default_model() == envs.PIECEWORKS_DEFAULT_MODEL
    from pieceworks.models.loading import sources

    monkeypatch.setattr(sources, "is_smollm2_installed", lambda: True)
    assert ea.text_default_model() == sources.SMOLLM2_NAME
    monkeypatch.setattr(sources, "is_smollm2_installed", lambda: False)
    assert ea.text_default_model() == envs.PIECEWORKS_DEFAULT_MODEL


def test_sampling_flags_give_sampling_params():
    params = ea.sampling_params(parser().parse_args([]))
    assert (params.temperature, params.top_p, params.top_k, params.max_tokens) == (0.0, 1.0, 0, 7)
    assert (params.seed, params.stop, params.logprobs, params.n) == (None, (), None, 1)
    argv = ["--max-tokens", "5", "--temperature", "0.5", "--top-p", "0.9", "--top-k", "3"]
    argv += ["--sampling-seed", "11", "--stop", "a", "--stop", "b", "--logprobs", "2", "-n", "2"]
    params = ea.sampling_params(parser().parse_args(argv))
    assert (params.temperature, params.top_p, params.top_k, params.max_tokens) == (0.5, 0.9, 3, 5)
    assert (params.seed, params.stop, params.logprobs, params.n) == (11, ("a", "b"), 2, 2)
    assert ea.sampling_params(argparse.Namespace(**vars(parser().parse_args([])))).max_tokens == 7
    default = argparse.ArgumentParser()
    ea.add_sampling_args(default)
    assert default.parse_args([]).max_tokens == 64


def test_help_says_what_the_flags_do():
    text = " ".join(parser().format_help().split())
    for phrase in (
        "a preset (llama-tiny, llama-125m, ...), smollm2-135m, gemma3-270m, a *.gguf file or "
        "an HF dir",
        "no compilation, no graphs",
        "wait for each step's tokens before scheduling the next (default: overlap them)",
        "compute every prompt in full (default: reuse the KV of cached prompt blocks)",
        "compilation level",
        """CompilationConfig fields as a JSON object, e.g. '{"level": 3}'""",
        "a stop string (repeat for several)",
        "top-k logprobs per token",
        "completions per prompt",
    ):
        assert phrase in text
