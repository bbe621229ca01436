"""``pieceworks bench serve`` (load a running server) and ``bench throughput`` (offline tokens/s).

Flags follow vLLM's benchmark_serving and benchmark_throughput: ``--num-prompts``,
``--input-len``, ``--output-len``, ``--range-ratio``, ``--request-rate``, ``--max-concurrency``,
``--dataset-path``, ``--output-json``; ``bench throughput`` takes the engine flags too.
``bench serve --workload`` picks the prompts: ``random`` (the default), ``shared-prefix`` (a
common system prompt of ``--prefix-len`` tokens plus ``--input-len`` of its own per request) or
``multi-turn`` (chats of ``--num-turns`` turns that resend their history); every workload reports
the server's prefix-cache hit rate beside TTFT.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

from pieceworks.entrypoints.engine_args import add_engine_args, compilation_fields, engine_args


def _served_model(base_url: str, api_key: str | None) -> str:
    """The first model the server lists (what ``--model`` defaults to)."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = httpx.get(f"{base_url}/v1/models", headers=headers, timeout=30)
    except httpx.HTTPError as error:
        message = f"no server answers at {base_url} ({error}); start `pieceworks serve`"
        raise RuntimeError(message) from None
    response.raise_for_status()
    return response.json()["data"][0]["id"]


def _require_matplotlib() -> None:
    """``--plot`` draws with matplotlib: refuse at once, saying how to install it."""
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        raise RuntimeError(
            "--plot needs matplotlib, which is not installed: pip install matplotlib"
        )


def _json_object(text: str) -> dict[str, Any]:
    """``--extra-body``'s value: a JSON object, or an argparse error saying what it got."""
    try:
        value = json.loads(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"not JSON ({error}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"a JSON object is needed, not {text!r}")
    return value


def cmd_bench_serve(args: argparse.Namespace) -> int:
    """Send the requests, print vLLM's summary, write JSON and a plot when asked."""
    from pieceworks.benchmarks.report import write_json
    from pieceworks.benchmarks.serve import format_summary, plot_serve, run_benchmark, summarize
    from pieceworks.benchmarks.serve_workloads import (
        engine_phase_means,
        engine_phase_totals,
        prefix_cache_counts,
        prefix_cache_hit_rate,
    )

    if args.plot:
        _require_matplotlib()  # before the run, not after it
    base_url = args.base_url.rstrip("/")
    model = args.model or _served_model(base_url, args.api_key)
    requests = _workload_requests(args)
    if args.num_warmups and args.workload != "multi-turn":
        asyncio.run(
            run_benchmark(base_url, model, requests[: args.num_warmups], api_key=args.api_key)
        )
    before = prefix_cache_counts(base_url, args.api_key)
    phases_before = engine_phase_totals(base_url, args.api_key)
    cpu_before = time.process_time()
    results, duration = asyncio.run(_run_workload(args, base_url, model, requests))
    client_cpu = time.process_time() - cpu_before  # this process: the load generator's own work
    after = prefix_cache_counts(base_url, args.api_key)
    phases = engine_phase_means(phases_before, engine_phase_totals(base_url, args.api_key))
    summary = {
        **summarize(results, duration),
        **prefix_cache_hit_rate(before, after),
        **phases,
    }
    summary["client_cpu_share"] = client_cpu / duration if duration else None
    config = {
        "base_url": base_url, "model": model, "workload": args.workload,
        "num_prompts": args.num_prompts, "input_len": args.input_len,
        "output_len": args.output_len, "prefix_len": args.prefix_len,
        "num_turns": args.num_turns, "range_ratio": args.range_ratio,
        "request_rate": args.request_rate, "max_concurrency": args.max_concurrency,
        "dataset_path": args.dataset_path, "extra_body": args.extra_body,
    }  # fmt: skip
    print(format_summary(summary))
    if args.output_json:
        write_json(Path(args.output_json), {**config, **summary})
    if args.plot:
        concurrency = args.max_concurrency or "unbounded"
        title = f"{model}: rate {args.request_rate}/s, concurrency {concurrency}"
        plot_serve(Path(args.plot), results, title)
    return 0 if summary["completed"] else 1


def _workload_requests(args: argparse.Namespace) -> Any:
    """The requests (or, for ``multi-turn``, the chats) that ``--workload`` names."""
    from pieceworks.benchmarks import serve_workloads as workloads
    from pieceworks.benchmarks.serve import sample_requests

    if args.workload == "shared-prefix":
        return workloads.shared_prefix_requests(
            args.num_prompts, args.prefix_len, args.input_len, args.output_len,
            args.vocab_size, args.seed,
        )  # fmt: skip
    if args.workload == "multi-turn":
        return workloads.multi_turn_chats(
            args.num_prompts, args.num_turns, args.input_len, args.output_len,
            args.vocab_size, args.seed,
        )  # fmt: skip
    return sample_requests(
        args.num_prompts, args.input_len, args.output_len, args.range_ratio,
        args.vocab_size, args.dataset_path, args.seed,
    )  # fmt: skip


async def _run_workload(args: argparse.Namespace, base_url: str, model: str, requests: Any) -> Any:
    from pieceworks.benchmarks.serve import run_benchmark
    from pieceworks.benchmarks.serve_workloads import run_multi_turn

    run = run_multi_turn if args.workload == "multi-turn" else run_benchmark
    return await run(
        base_url, model, requests, args.request_rate, args.max_concurrency, args.api_key,
        seed=args.seed, extra_body=args.extra_body,
    )  # fmt: skip


def cmd_bench_throughput(args: argparse.Namespace) -> int:
    """Time one generate over many prompts; print and optionally write the numbers."""
    from pieceworks.benchmarks.report import write_json
    from pieceworks.benchmarks.throughput import measure_throughput

    result = measure_throughput(
        args.model, args.num_prompts, args.input_len, args.output_len, args.range_ratio,
        args.seed or 0, compilation_fields(args) or None, **engine_args(args),
    )  # fmt: skip
    print(
        f"Throughput: {result['requests_per_s']:.2f} requests/s, "
        f"{result['total_tokens_per_s']:.1f} total tokens/s, "
        f"{result['output_tokens_per_s']:.1f} output tokens/s "
        f"({result['num_prompts']} prompts in {result['elapsed_s']:.2f} s)"
    )
    if args.output_json:
        write_json(Path(args.output_json), result)
    return 0


def _add_lengths(parser: argparse.ArgumentParser, num_prompts: int) -> None:
    parser.add_argument("--num-prompts", type=int, default=num_prompts)
    parser.add_argument("--input-len", type=int, default=32, help="prompt tokens (random prompts)")
    parser.add_argument("--output-len", type=int, default=128, help="tokens generated per request")
    parser.add_argument(
        "--range-ratio", type=float, default=0.0,
        help="sample lengths uniformly in [len * (1 - r), len * (1 + r)] (0: fixed lengths)",
    )  # fmt: skip
    parser.add_argument("--output-json", default=None)


def register_serve(bench: Any) -> None:
    """Add ``bench serve`` and ``bench throughput`` to the ``bench`` subcommands."""
    serve = bench.add_parser("serve", help="load a running server (vLLM's benchmark_serving)")
    serve.add_argument("--base-url", default="http://127.0.0.1:8000")
    serve.add_argument("--model", default=None, help="served model name (default: the first)")
    serve.add_argument("--api-key", default=None)
    _add_lengths(serve, 200)
    serve.add_argument(
        "--request-rate", type=float, default=float("inf"),
        help="Poisson arrivals per second (inf: send every request at once)",
    )  # fmt: skip
    serve.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight")
    serve.add_argument("--dataset-path", default=None, help="a text file: one prompt per line")
    serve.add_argument(
        "--workload", default="random", choices=["random", "shared-prefix", "multi-turn"],
        help="random prompts; a shared system prompt plus a question each; or multi-turn chats "
        "that resend their history",
    )  # fmt: skip
    serve.add_argument(
        "--prefix-len", type=int, default=256, help="shared-prefix: the system prompt's tokens"
    )
    serve.add_argument(
        "--num-turns", type=int, default=4,
        help="multi-turn: turns per chat (num-prompts // num-turns chats)",
    )  # fmt: skip
    serve.add_argument("--vocab-size", type=int, default=256, help="random prompt ids below this")
    serve.add_argument("--num-warmups", type=int, default=0, help="requests sent before timing")
    serve.add_argument("--seed", type=int, default=0)
    serve.add_argument("--plot", default=None, help="PNG path (TTFT, TPOT, ITL distributions)")
    serve.add_argument(
        "--extra-body", type=_json_object, default=None,
        help="JSON object merged into every request, e.g. "
        '\'{"response_format": {"type": "json_object"}}\' (a structured-output run)',
    )  # fmt: skip
    serve.set_defaults(func=cmd_bench_serve)

    throughput = bench.add_parser("throughput", help="offline tokens/s over many prompts")
    add_engine_args(throughput, "llama-125m")
    _add_lengths(throughput, 256)
    throughput.set_defaults(func=cmd_bench_throughput)
