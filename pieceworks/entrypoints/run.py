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
    from pieceworks.benchmarks.latency import LatencyCase, measure_copy_bandwidth
    from pieceworks.benchmarks.report import format_compile_cache, format_mode_table, format_notes
    from pieceworks.entrypoints.bench import measure_rows, plan_rows
    from pieceworks.platforms import current_platform, describe_platform_resolution

    platform = current_platform()
    print(describe_platform_resolution())
    print(f"device: {platform.device_name()}")
    case = LatencyCase(
        args.model,
        args.batch_size,
        args.input_len,
        args.output_len,
        num_iters_warmup=args.num_iters_warmup,
        num_iters=args.num_iters,
        engine_args={"max_num_seqs": max(args.batch_size, 8), **engine_args(args)},
        compilation=compilation_fields(args),
    )
    plans = plan_rows(args, case)
    bandwidth = measure_copy_bandwidth(256 << 20)
    results = list(measure_rows(case, plans, [], bandwidth))
    print(
        f"\nmodel {args.model}: batch {args.batch_size}, input {args.input_len}, "
        f"output {args.output_len} tokens, greedy"
    )
    print(format_mode_table(results))
    notes = format_notes(results, [])
    print(f"{notes}\n" if notes else "", end="")
    print("(column meanings: pieceworks run --help)")
    print(f"\n{format_compile_cache(results)}")
    measured = [r for r in results if r["status"] == "ok"]
    tokens = {r["mode"]: r["first_output_token_ids"] for r in measured}
    if tokens:
        same = len({tuple(t) for t in tokens.values()}) == 1
        print(
            f"\nfirst prompt, first tokens: {next(iter(tokens.values()))} "
            f"({'identical across modes' if same else 'DIFFERENT across modes: ' + str(tokens)})"
        )
    return 0 if len(measured) == len(results) else 1


def register(sub: Any) -> None:
    from pieceworks.benchmarks.report import column_help

    run = sub.add_parser(
        "run",
        help="the default job: compile, capture, generate, report",
        epilog=column_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_engine_args(run, default_model())
    run.add_argument(
        "--modes",
        default=None,
        help="comma list (default: what the platform has; a mode that contradicts "
        "-O/--enforce-eager/--compilation-config is an error)",
    )
    run.add_argument("--batch-size", type=int, default=4)
    run.add_argument("--input-len", type=int, default=16)
    run.add_argument("--output-len", type=int, default=16)
    run.add_argument("--num-iters-warmup", type=int, default=2)
    run.add_argument("--num-iters", type=int, default=5)
    run.set_defaults(func=cmd_run)
