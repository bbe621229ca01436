"""``pieceworks bench ...``: the product benchmarks (``bench latency``; ``bench serve`` and
``bench throughput`` in ``bench_serve``)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from pieceworks.entrypoints.bench_serve import register_serve
from pieceworks.entrypoints.engine_args import add_engine_args, compilation_fields, engine_args


def _measurements(modes: list[str], compare: bool) -> list[tuple[str, Any]]:
    """(mode, measuring function) pairs: pieceworks' modes, then the baselines with --compare."""
    from pieceworks.benchmarks.latency import measure_mode

    pairs: list[tuple[str, Any]] = [(mode, measure_mode) for mode in modes]
    if compare:  # after the engines: the static baseline resets torch.compile's global state
        from pieceworks.benchmarks.baselines import measure_hf_eager, measure_static_cache_compiled

        pairs.append(("static_compiled", lambda c, _, b: measure_static_cache_compiled(c, b)))
        pairs.append(("hf_eager", lambda c, _, b: measure_hf_eager(c, b)))
    return pairs


def cmd_bench_latency(args: argparse.Namespace) -> int:
    """Latency per mode and batch size, side by side in one run; JSON and a PNG plot."""
    from pieceworks.benchmarks.latency import LatencyCase, measure_copy_bandwidth
    from pieceworks.benchmarks.report import format_mode_table, plot_latency, write_json
    from pieceworks.engine.modes import default_modes, parse_modes
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


def register(sub: Any) -> None:
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
    register_serve(bench)
