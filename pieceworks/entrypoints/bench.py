"""``pieceworks bench ...``: the product benchmarks (``bench latency``, ``bench startup``;
``bench serve`` and ``bench throughput`` in ``bench_serve``)."""

from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path
from typing import Any

from pieceworks.entrypoints.bench_serve import register_serve
from pieceworks.entrypoints.engine_args import add_engine_args, compilation_fields, engine_args


def _case(args: argparse.Namespace, batch_size: int) -> Any:
    from pieceworks.benchmarks.latency import LatencyCase

    return LatencyCase(
        args.model,
        batch_size,
        args.input_len,
        args.output_len,
        args.num_iters_warmup,
        args.num_iters,
        {"max_num_seqs": max(batch_size, 8), **engine_args(args)},
        compilation_fields(args),
        kernel_breakdown=args.kernel_breakdown,
    )


def prompt_kinds(args: argparse.Namespace) -> list[str]:
    """``--prompt-kind``'s kinds; ``copy`` refused, naming the option, for a model without a
    tokenizer (before any engine is built)."""
    from pieceworks.benchmarks.prompts import check_prompt_kinds, parse_prompt_kinds

    kinds = parse_prompt_kinds(args.prompt_kind)
    if "copy" in kinds:
        from pieceworks.engine.tokenizer import load_tokenizer

        check_prompt_kinds(kinds, load_tokenizer(args.model))
    return kinds


def plan_rows(args: argparse.Namespace, case: Any) -> Any:
    """The pieceworks rows of this run (``benchmarks.mode_plan``): flags honoured, conflicts an
    error, rows of the same effective configuration merged."""
    from functools import partial

    from pieceworks.benchmarks.latency import resolve_effective
    from pieceworks.benchmarks.mode_plan import plan_modes
    from pieceworks.platforms import current_platform

    return plan_modes(
        args.modes,
        compilation_fields(args),
        args.enforce_eager,
        current_platform().capabilities().static_graphs,
        partial(resolve_effective, case),
    )


def measure_rows(
    case: Any,
    plans: list[Any],
    baselines: list[str],
    bandwidth: float,
    prompt_kinds: list[str] | None = None,
) -> Any:
    """Each mode (one engine, a row per prompt kind), then each baseline per prompt kind, as
    result dicts; one that raises becomes a failed row."""
    import dataclasses
    from functools import partial

    from pieceworks.benchmarks.baselines import BASELINES
    from pieceworks.benchmarks.latency import measure_mode, with_output_rate

    kinds = prompt_kinds or [case.prompt_kind]
    for plan in plans:
        yield from _guarded(
            partial(measure_mode, case, plan, bandwidth, prompt_kinds=kinds),
            plan.name,
            kinds,
            level=plan.level,
            graph_mode=plan.graph_mode,
        )
    # After the engines: the static loops reset torch.compile's global state when they finish.
    for name in baselines:
        for kind in kinds:
            kind_case = dataclasses.replace(case, prompt_kind=kind)
            measure = partial(BASELINES[name], kind_case, bandwidth)
            (row,) = _guarded(
                lambda m=measure, c=kind_case: [with_output_rate(m(), c)],
                name,
                [kind],
                level=None,
                graph_mode="baseline",
            )
            yield row


def _guarded(measure: Any, name: str, kinds: list[str], **fields: Any) -> list[dict[str, Any]]:
    """``measure()`` (its rows), or a failed row per prompt kind of what it raised (after the
    exception, and the frames holding a failed engine's memory, are gone, that memory is
    returned)."""
    from pieceworks.benchmarks.latency import failed_result, free_device_memory

    try:
        return measure()
    except Exception as error:  # noqa: BLE001 (reported in its row; the run goes on)
        failed = failed_result(name, error, **fields)
        results = [{**failed, "prompt_kind": kind, "output_tokens_per_s": None} for kind in kinds]
    free_device_memory()
    return results


def choose_peers(
    text: str, applicable: list[str], skipped: list[dict[str, str]]
) -> tuple[list[str], list[dict[str, str]]]:
    """``--peers``: the applicable peers named in ``text``; the rest are skipped, saying why."""
    from pieceworks.benchmarks.baselines import BASELINE_MODES

    wanted = [name.strip() for name in text.split(",") if name.strip()]
    unknown = sorted(set(wanted) - set(BASELINE_MODES))
    if unknown:
        raise ValueError(f"unknown peer(s) {unknown}; choose from {', '.join(BASELINE_MODES)}")
    not_asked = [
        {"mode": name, "reason": "not in --peers"} for name in applicable if name not in wanted
    ]
    return [name for name in applicable if name in wanted], skipped + not_asked


_CASE_FLAGS = ("model", "batch_size", "input_len", "output_len")
_NOT_IN_COMMAND = ("help", "commit", "output_json", "plot")


def command_line(args: argparse.Namespace) -> str:
    """The ``pieceworks bench latency`` command that reruns this one: the flags that define the
    case always, the others where they differ from their default; where results are written
    (``--output-json``, ``--plot``) and ``--commit`` are not part of it."""
    words = ["pieceworks", "bench", "latency"]
    for action in args.parser._actions:
        if not action.option_strings or action.dest in _NOT_IN_COMMAND:
            continue
        value = getattr(args, action.dest, action.default)
        if value == action.default and action.dest not in _CASE_FLAGS:
            continue
        flag = action.option_strings[-1]
        if action.nargs == 0:  # store_true / store_false
            words.append(flag)
        else:
            text = json.dumps(value) if isinstance(value, dict) else str(value)
            words += [flag, shlex.quote(text)]
    return " ".join(words)


def _print_progress(result: dict[str, Any]) -> None:
    from pieceworks.benchmarks.report import row_label

    label = f"batch {result['batch_size']} {row_label(result)}"
    if result.get("status") != "ok":
        print(f"{label}: FAILED {result['error']}", flush=True)
        return
    steps = result["decode_step_ms"]
    level = "-" if result["level"] is None else result["level"]
    rate = result.get("output_tokens_per_s")
    line = (
        f"{label} (level {level}, {result['graph_mode']}): median "
        f"{result['latency_s']['median']:.4f} s, {rate or float('nan'):.1f} output tokens/s, "
        f"{steps['median']:.3f} ms/step (min {steps['min']:.3f}, max {steps['max']:.3f})"
    )
    spec = result.get("speculative")
    if spec:
        line += (
            f", acceptance {spec['acceptance_rate']:.0%}, mean accepted length "
            f"{spec['mean_accepted_length']:.2f}"
        )
    print(line, flush=True)


def cmd_bench_latency(args: argparse.Namespace) -> int:
    """Latency per mode and batch size, side by side in one run; JSON and a PNG plot.

    The JSON is rewritten after every row, so a run killed part-way keeps what it measured.
    """
    from pieceworks.benchmarks.baselines import applicable_baselines
    from pieceworks.benchmarks.kernel_report import format_kernel_breakdown
    from pieceworks.benchmarks.latency import measure_copy_bandwidth, run_environment
    from pieceworks.benchmarks.report import (
        format_mode_table,
        format_notes,
        plot_latency,
        write_json,
    )
    from pieceworks.kernels.programmatic_launch import programmatic_launch_enabled
    from pieceworks.platforms import current_platform

    platform = current_platform()
    batch_sizes = [int(b) for b in args.batch_size.split(",")]
    kinds = prompt_kinds(args)
    plans_case = _case(args, batch_sizes[0])
    plans = plan_rows(args, plans_case)  # conflicts fail before any work
    baselines, skipped = applicable_baselines(plans_case) if args.compare else ([], [])
    if args.compare and args.peers:
        baselines, skipped = choose_peers(args.peers, baselines, skipped)
    bandwidth = measure_copy_bandwidth()
    num_scheduler_steps = engine_args(args).get("num_scheduler_steps", 1)
    print(
        f"platform {platform.name} ({platform.device_name()}); device copy bandwidth "
        f"{bandwidth / 1e9:.0f} GB/s; {num_scheduler_steps} decode step(s) per host round trip "
        "(--num-scheduler-steps)"
    )
    payload: dict[str, Any] = {
        "model": args.model,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "batch_sizes": batch_sizes,
        "prompt_kinds": kinds,
        "num_scheduler_steps": num_scheduler_steps,
        "command": command_line(args),
        **run_environment(args.model, engine_args(args), args.commit),
        "copy_bandwidth_gbps": bandwidth / 1e9,
        # With programmatic dependent launch a kernel may start before the one it waits for
        # ends: the breakdown's per-kernel times then include that wait (PIECEWORKS_PDL=0).
        "programmatic_launch": programmatic_launch_enabled(),
        "skipped": skipped,
        "results": [],
    }
    results = payload["results"]
    for batch_size in batch_sizes:
        rows = measure_rows(_case(args, batch_size), plans, baselines, bandwidth, kinds)
        for result in rows:
            results.append({**result, "batch_size": batch_size})
            _print_progress(results[-1])
            if args.output_json:
                write_json(Path(args.output_json), payload)
    print(format_mode_table(results))
    breakdown = format_kernel_breakdown(results)
    if breakdown:
        print(breakdown)
    notes = format_notes(results, skipped)
    if notes:
        print(notes)
    if args.plot:
        title = (
            f"{args.model}, in {args.input_len}, out {args.output_len} ({platform.device_name()})"
        )
        plot_latency(Path(args.plot), results, title)
    failed = [f"batch {r['batch_size']} {r['mode']}" for r in results if r["status"] != "ok"]
    if failed:
        print(f"failed: {', '.join(failed)} (their errors are in the table and the JSON)")
    return 1 if failed else 0


def cmd_bench_startup(args: argparse.Namespace) -> int:
    """Cold and warm start-up, each in a fresh process, phase by phase; a table and JSON."""
    from pieceworks.benchmarks.latency import run_environment
    from pieceworks.benchmarks.report import write_json
    from pieceworks.benchmarks.startup import format_startup_table, run_startup

    engine = {"max_num_seqs": max(args.batch_size, 8), **engine_args(args)}
    rows = run_startup(
        args.model,
        args.batch_size,
        args.input_len,
        engine,
        compilation_fields(args),
        reuse_inductor_cache=args.reuse_inductor_cache,
    )
    print(format_startup_table(rows))
    if args.output_json:
        payload = {
            "model": args.model,
            "batch_size": args.batch_size,
            "input_len": args.input_len,
            "engine_args": engine,
            "reuse_inductor_cache": args.reuse_inductor_cache,
            # dtype, device, versions, commit, date: asked after the runs, in this process
            **run_environment(args.model, engine, None),
            "results": rows,
        }
        write_json(Path(args.output_json), payload)
    return 0 if all(row["status"] == "ok" for row in rows) else 1


def register_startup(bench: Any) -> None:
    startup = bench.add_parser(
        "startup",
        help="cold and warm start-up, each in a fresh process, split into phases",
        description="Build the engine and run its first step in a fresh process twice: cold "
        "(pieceworks', Inductor's and Triton's caches empty) and warm (pieceworks' cache as the "
        "cold run left it; Inductor's and Triton's empty again unless --reuse-inductor-cache).",
    )
    add_engine_args(startup, "llama-125m")
    startup.add_argument("--batch-size", type=int, default=1)
    startup.add_argument("--input-len", type=int, default=32)
    startup.add_argument(
        "--reuse-inductor-cache",
        action="store_true",
        help="the warm run keeps the cold run's Inductor and Triton caches as well",
    )
    startup.add_argument("--output-json", default=None)
    startup.set_defaults(func=cmd_bench_startup, parser=startup)


def register(sub: Any) -> None:
    from pieceworks.benchmarks.report import column_help

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    latency = bench.add_parser(
        "latency",
        help="vLLM's benchmark_latency shape, modes side by side",
        description="Time generation of --batch-size prompts (--prompt-kind) of --input-len "
        "tokens, --output-len tokens each (greedy, ignore_eos), for each mode (and peer with "
        "--compare) in one run.",
        epilog=column_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_engine_args(latency, "llama-125m")
    latency.add_argument("--batch-size", default="8", help="one or a comma list")
    latency.add_argument("--input-len", type=int, default=32)
    latency.add_argument("--output-len", type=int, default=128)
    latency.add_argument(
        "--prompt-kind",
        default="random",
        help="one or a comma list, each a row per mode on the same engine: random (random token "
        "ids), repeat (a random passage of about input-len/4 tokens repeated: n-gram "
        "speculation finds matches), copy (an English passage and an instruction to repeat it, "
        "in the chat template; needs a model with a tokenizer)",
    )
    latency.add_argument("--num-iters-warmup", type=int, default=2)
    latency.add_argument("--num-iters", type=int, default=5)
    latency.add_argument(
        "--modes",
        default=None,
        help="comma list, e.g. eager,piecewise,full_and_piecewise (default: the platform's; "
        "a mode that contradicts -O/--enforce-eager/--compilation-config is an error)",
    )
    latency.add_argument(
        "--compare",
        action="store_true",
        help="also time the peers that apply to the model: static_compiled (HF transformers "
        "with a static cache under torch.compile reduce-overhead), gpt_fast (an independent "
        "hand-written Llama loop) and hf_eager (HF generate); the others are listed as skipped",
    )
    latency.add_argument(
        "--peers",
        default=None,
        help="with --compare: comma list of the peers to run (default: every one that applies)",
    )
    latency.add_argument(
        "--kernel-breakdown",
        action="store_true",
        help="from the device-busy profile, also each row's per-kernel budget of a decode step "
        "(kernels per step and per layer, kernel time, gaps between kernels, the top kernels): "
        "printed, and a kernel_breakdown object in each JSON row; n/a where the platform "
        "traces no device work (the CPU)",
    )
    latency.add_argument("--output-json", default=None)
    latency.add_argument("--plot", default=None, help="PNG path")
    latency.add_argument(
        "--commit", default=None, help="source commit recorded in the JSON (default: git's)"
    )
    latency.set_defaults(func=cmd_bench_latency, parser=latency)
    register_startup(bench)
    register_serve(bench)
