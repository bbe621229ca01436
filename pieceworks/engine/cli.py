"""The ``pieceworks`` command line: ``run``, ``generate``, ``bench latency``, ``platforms``.

Each subcommand is a small function over the Python API (``LLM``, ``engine.benchmark``); engine
arguments keep vLLM's flag names (``--max-num-seqs``, ``--max-model-len``, ``-O``,
``--compilation-config '{json}'``, ``--enforce-eager``).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ENGINE_FLAGS: list[tuple[str, dict[str, Any]]] = [
    ("--dtype", {"default": "auto", "choices": ["auto", "float32", "bfloat16", "float16"]}),
    ("--max-model-len", {"type": int, "default": None}),
    ("--max-num-seqs", {"type": int, "default": None}),
    ("--max-num-batched-tokens", {"type": int, "default": None}),
    ("--block-size", {"type": int, "default": None}),
    ("--gpu-memory-utilization", {"type": float, "default": None}),
    ("--num-gpu-blocks-override", {"type": int, "default": None}),
    ("--quantization", {"default": None, "choices": ["fp8"]}),
    ("--tensor-parallel-size", {"type": int, "default": None}),
    ("--seed", {"type": int, "default": None}),
]


def add_engine_args(parser: argparse.ArgumentParser, default_model: str | None) -> None:
    parser.add_argument(
        "--model",
        default=default_model,
        help="a preset (llama-tiny, llama-125m, llama-3.1-8b, ...) or an HF dir",
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
        "-O", dest="level", type=int, choices=[0, 1, 2, 3], default=None, help="compilation level"
    )
    parser.add_argument(
        "--compilation-config",
        type=json.loads,
        default=None,
        help="CompilationConfig fields as JSON",
    )


def engine_args(args: argparse.Namespace) -> dict[str, Any]:
    names = [flag.lstrip("-").replace("-", "_") for flag, _ in ENGINE_FLAGS]
    values = {name: getattr(args, name) for name in names if getattr(args, name) is not None}
    if args.enforce_eager:
        values["enforce_eager"] = True
    if not args.async_scheduling:
        values["async_scheduling"] = False
    return values


def compilation_fields(args: argparse.Namespace) -> dict[str, Any]:
    fields = dict(args.compilation_config or {})
    if args.level is not None:
        fields["level"] = args.level
    return fields


def _default_model() -> str:
    from pieceworks import envs

    return envs.PIECEWORKS_DEFAULT_MODEL


def cmd_platforms(args: argparse.Namespace) -> int:
    """Print every platform known, whether it is available and why not, and which resolved."""
    from pieceworks.platforms import describe_platform_resolution

    print(describe_platform_resolution())
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    """The default job: every available mode on a small model, and a report."""
    from pieceworks.engine.benchmark import LatencyCase, measure_copy_bandwidth, measure_mode
    from pieceworks.engine.modes import default_modes, parse_modes
    from pieceworks.engine.report import format_compile_cache, format_mode_table
    from pieceworks.platforms import current_platform, describe_platform_resolution

    platform = current_platform()
    print(describe_platform_resolution())
    print(f"device: {platform.device_name()}")
    modes = (
        parse_modes(args.modes) if args.modes else default_modes(platform.supports_static_graphs())
    )
    case = LatencyCase(
        args.model,
        args.batch_size,
        args.input_len,
        args.output_len,
        num_iters_warmup=1,
        num_iters=args.num_iters,
        engine_args={"max_num_seqs": max(args.batch_size, 8), **engine_args(args)},
        compilation=compilation_fields(args),
    )
    bandwidth = measure_copy_bandwidth(256 << 20)
    results = [measure_mode(case, mode, bandwidth) for mode in modes]
    print(
        f"\nmodel {args.model}: batch {args.batch_size}, input {args.input_len}, "
        f"output {args.output_len} tokens, greedy"
    )
    print(format_mode_table(results))
    print(f"\n{format_compile_cache(results)}")
    tokens = {r["mode"]: r["first_output_token_ids"] for r in results}
    same = len({tuple(t) for t in tokens.values()}) == 1
    print(
        f"\nfirst prompt, first tokens: {next(iter(tokens.values()))} "
        f"({'identical across modes' if same else 'DIFFERENT across modes: ' + str(tokens)})"
    )
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    """Generate from prompts given as text (needs a tokenizer) or comma-separated token ids."""
    from pieceworks.engine.llm import LLM
    from pieceworks.engine.sampling_params import SamplingParams

    prompts: list[Any] = [p if args.text else [int(t) for t in p.split(",")] for p in args.prompts]
    llm = LLM(args.model, compilation_config=compilation_fields(args) or None, **engine_args(args))
    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_tokens=args.max_tokens,
        seed=args.sampling_seed,
    )
    for output in llm.generate(prompts, params):
        completion = output.outputs[0]
        shown = completion.text if completion.text is not None else completion.token_ids
        print(f"[{output.request_id}] ({completion.finish_reason}) {shown}")
    return 0


def _measurements(modes: list[str], compare: bool) -> list[tuple[str, Any]]:
    """(mode, measuring function) pairs: pieceworks' modes, then the baselines with --compare."""
    from pieceworks.engine.benchmark import measure_mode

    pairs: list[tuple[str, Any]] = [(mode, measure_mode) for mode in modes]
    if compare:  # after the engines: the static baseline resets torch.compile's global state
        from pieceworks.engine.baselines import measure_hf_eager, measure_static_cache_compiled

        pairs.append(("static_compiled", lambda c, _, b: measure_static_cache_compiled(c, b)))
        pairs.append(("hf_eager", lambda c, _, b: measure_hf_eager(c, b)))
    return pairs


def cmd_bench_latency(args: argparse.Namespace) -> int:
    """Latency per mode and batch size, side by side in one run; JSON and a PNG plot."""
    from pieceworks.engine.benchmark import LatencyCase, measure_copy_bandwidth
    from pieceworks.engine.modes import default_modes, parse_modes
    from pieceworks.engine.report import format_mode_table, plot_latency, write_json
    from pieceworks.platforms import current_platform

    platform = current_platform()
    modes = (
        parse_modes(args.modes) if args.modes else default_modes(platform.supports_static_graphs())
    )
    bandwidth = measure_copy_bandwidth()
    print(
        f"platform {platform.name} ({platform.device_name()}); device copy bandwidth "
        f"{bandwidth / 1e9:.0f} GB/s"
    )
    results = []
    for batch_size in [int(b) for b in args.batch_size.split(",")]:
        case = LatencyCase(
            args.model,
            batch_size,
            args.input_len,
            args.output_len,
            args.num_iters_warmup,
            args.num_iters,
            {"max_num_seqs": max(batch_size, 8), **engine_args(args)},
            compilation_fields(args),
        )
        for mode, measure in _measurements(modes, args.compare):
            result = {**measure(case, mode, bandwidth), "batch_size": batch_size}
            results.append(result)
            print(
                f"batch {batch_size} {mode}: median {result['latency_s']['median']:.4f} s, "
                f"{result['decode_step_ms']['median']:.3f} ms/step",
                flush=True,
            )
    print(format_mode_table(results))
    payload = {
        "model": args.model,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "platform": platform.name,
        "device": platform.device_name(),
        "copy_bandwidth_gbps": bandwidth / 1e9,
        "results": results,
    }
    if args.output_json:
        write_json(Path(args.output_json), payload)
    if args.plot:
        plot_latency(
            Path(args.plot),
            results,
            f"{args.model}, in {args.input_len}, out {args.output_len} ({platform.device_name()})",
        )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pieceworks", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("platforms", help="show the platforms probed and the one chosen").set_defaults(
        func=cmd_platforms
    )

    run = sub.add_parser("run", help="the default job: compile, capture, generate, report")
    add_engine_args(run, _default_model())
    run.add_argument("--modes", default=None, help="comma list (default: what the platform has)")
    run.add_argument("--batch-size", type=int, default=4)
    run.add_argument("--input-len", type=int, default=16)
    run.add_argument("--output-len", type=int, default=16)
    run.add_argument("--num-iters", type=int, default=2)
    run.set_defaults(func=cmd_run)

    generate = sub.add_parser("generate", help="generate from prompts")
    add_engine_args(generate, _default_model())
    generate.add_argument("prompts", nargs="+", help="token ids '1,2,3' (or text with --text)")
    generate.add_argument("--text", action="store_true", help="prompts are text (needs tokenizer)")
    generate.add_argument("--max-tokens", type=int, default=16)
    generate.add_argument("--temperature", type=float, default=0.0)
    generate.add_argument("--top-p", type=float, default=1.0)
    generate.add_argument("--top-k", type=int, default=0)
    generate.add_argument("--sampling-seed", type=int, default=None)
    generate.set_defaults(func=cmd_generate)

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    latency = bench.add_parser("latency", help="vLLM's benchmark_latency shape, modes side by side")
    add_engine_args(latency, "llama-125m")
    latency.add_argument("--batch-size", default="8", help="one or a comma list")
    latency.add_argument("--input-len", type=int, default=32)
    latency.add_argument("--output-len", type=int, default=128)
    latency.add_argument("--num-iters-warmup", type=int, default=2)
    latency.add_argument("--num-iters", type=int, default=5)
    latency.add_argument("--modes", default=None, help="comma list, e.g. eager,piecewise,full")
    latency.add_argument(
        "--compare",
        action="store_true",
        help="also time torch.compile(reduce-overhead) on a static cache and HF "
        "transformers eager generation of the same model",
    )
    latency.add_argument("--output-json", default=None)
    latency.add_argument("--plot", default=None, help="PNG path")
    latency.set_defaults(func=cmd_bench_latency)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, RuntimeError, TypeError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
