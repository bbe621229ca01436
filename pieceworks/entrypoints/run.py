"""``pieceworks run``: the default job (every available mode on a small model, and a report)."""

from __future__ import annotations

import argparse
from typing import Any

from pieceworks.entrypoints.engine_args import (
    add_engine_args,
    compilation_fields,
    default_model,
    engine_args,
)


def cmd_run(args: argparse.Namespace) -> int:
    """The default job: every available mode on a small model, and a report."""
    from pieceworks.benchmarks.latency import LatencyCase, measure_copy_bandwidth, measure_mode
    from pieceworks.benchmarks.report import format_compile_cache, format_mode_table
    from pieceworks.engine.modes import default_modes, parse_modes
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


def register(sub: Any) -> None:
    run = sub.add_parser("run", help="the default job: compile, capture, generate, report")
    add_engine_args(run, default_model())
    run.add_argument("--modes", default=None, help="comma list (default: what the platform has)")
    run.add_argument("--batch-size", type=int, default=4)
    run.add_argument("--input-len", type=int, default=16)
    run.add_argument("--output-len", type=int, default=16)
    run.add_argument("--num-iters", type=int, default=2)
    run.set_defaults(func=cmd_run)
