"""The server process's own CPU time per output token under many streaming clients, by kind.

Starts ``pieceworks serve``'s two processes on a tiny model whose engine step costs little beside
the server's work (``llama-tiny`` with SmolLM2's vocabulary, eager, random weights, and SmolLM2's
tokenizer so that text is really detokenized), drives ``--concurrency`` streaming clients with
``bench serve``'s load generator from this process, and measures the server process (not the
engine process, not the clients) over the load only:

- ``cpu_us_per_token``: its CPU time (all threads, from ``/proc``) per streamed output token,
  without a profiler: the number to compare before and after a change;
- with ``--profile`` (a second server, the same load), a ``cProfile`` of its event loop on a
  CPU-time clock, each function's own time put in one bucket: ``receive`` (the output pipe, its
  unpickling, dispatching the deltas), ``detokenize`` (the detokenizer and the tokenizer), ``build``
  (choice deltas, chunk dicts, logprobs, JSON), ``sse write`` (``EventStream``, uvicorn's response
  path, the socket writes), ``event loop`` (asyncio: tasks, futures, queues, the selector) and
  ``other`` (request parsing, validation, metrics, ...). The profiler slows Python calls, so the
  buckets are shares of a profiled run, scaled to the unprofiled CPU time per token; the
  profiled run also counts the Python function calls per token, a figure that, unlike CPU time,
  does not move with the machine's other load.

    python benchmarks/profile_serve.py --concurrency 64 --num-prompts 256 --output-len 64 --profile
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import os
import pstats
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

BUCKETS = ("receive", "detokenize", "build", "metrics", "sse write", "event loop", "other")

# (bucket, substrings of "file:function"), first match wins.
RULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("detokenize", ("detokenizer.py", "serve/text.py", "tokenizers", "transformers/",
                    "method 'decode", "method 'decode_batch", "method 'step' of 'tokenizers")),
    ("receive", ("core_client.py", "async_engine.py", "messages.py", "multiprocessing/connection",
                 "_pickle.loads", "method 'recv", "posix.read", "stream_batch.py")),
    ("build", ("generation.py", "serving.py", "completions.py", "chat.py", "logprobs.py",
               "json/", "_json", "chunk_writer.py", "dataclasses.py", "method 'encode'")),
    ("metrics", ("prometheus_client", "serve/metrics.py", "bisect")),
    ("sse write", ("event_stream.py", "starlette/responses.py", "h11/", "uvicorn/protocols/http",
                   "anyio/", "selector_events.py", "method 'send' of '_socket", "UVStream",
                   "starlette/middleware", "starlette/_utils", "starlette/_exception_handler",
                   "concurrency.py")),
    ("event loop", ("asyncio/", "uvloop", "selectors.py", "method 'poll' of 'select",
                    "method 'control'", "_asyncio", "method 'send' of 'coroutine",
                    "method 'throw' of 'coroutine", "_contextvars", "method 'run' of 'Context")),
)  # fmt: skip


def bucket_of(key: tuple[str, int, str]) -> str:
    name = f"{key[0]}:{key[2]}"
    for bucket, needles in RULES:
        if any(needle in name for needle in needles):
            return bucket
    return "other"


def buckets(profile_path: str) -> dict[str, float]:
    """Own CPU seconds per bucket of a dumped profile. A built-in or frozen function
    (``isinstance``, ``len``, ``abc``'s checks) that no rule names goes, call by call, to the
    buckets of its callers."""
    stats = pstats.Stats(profile_path).stats  # type: ignore[attr-defined]
    totals = dict.fromkeys(BUCKETS, 0.0)

    def add(key: tuple[str, int, str], own: float, depth: int = 0) -> None:
        bucket = bucket_of(key)
        callers = stats[key][4] if key in stats else {}
        anonymous = key[0] == "~" or key[0].startswith("<frozen")
        if bucket != "other" or not anonymous or not callers or depth > 3:
            totals[bucket] += own
            return
        caller_own = sum(entry[2] for entry in callers.values()) or 1.0
        for caller, entry in callers.items():
            add(caller, own * entry[2] / caller_own, depth + 1)

    for key, (_, _, own, _, _) in stats.items():
        add(key, own)
    return totals


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, all its threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# ---- the server process ----


def run_server(args: argparse.Namespace) -> None:
    """Serve until SIGINT; SIGUSR1 starts the profiler, SIGUSR2 stops it and dumps it."""
    from pieceworks.engine.core_process import EngineSpec
    from pieceworks.engine.tokenizer import load_tokenizer
    from pieceworks.entrypoints.serve import build_process_context
    from pieceworks.entrypoints.serve.api_server import build_app, serve

    engine_args = {
        "max_num_seqs": args.max_num_seqs,
        "enforce_eager": True,
        "hf_overrides": {"vocab_size": args.vocab_size},
    }
    ctx = build_process_context(EngineSpec(args.model, None, engine_args), args.model, 1024)
    # The text side only: the model's random weights draw ids over the tokenizer's whole
    # vocabulary (``--vocab-size``), and every streamed token is decoded as that tokenizer's.
    ctx.tokenizer = load_tokenizer(args.tokenizer)
    profiler = cProfile.Profile(time.process_time)

    def start(signum: int, frame: object) -> None:
        profiler.enable()

    def stop(signum: int, frame: object) -> None:
        profiler.disable()
        profiler.dump_stats(args.profile_out)

    signal.signal(signal.SIGUSR1, start)
    signal.signal(signal.SIGUSR2, stop)
    try:
        serve(build_app(ctx, [args.model]), "127.0.0.1", args.port, "warning")
    finally:
        ctx.engine.shutdown()


# ---- the driver ----


def wait_until_up(port: int, server: subprocess.Popen[bytes], timeout_s: float = 600.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited with status {server.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1):
                return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"the server did not answer /health within {timeout_s} s")


def load(args: argparse.Namespace) -> dict[str, float]:
    from pieceworks.benchmarks.serve import run_benchmark, sample_requests, summarize

    requests = sample_requests(
        args.num_prompts, args.input_len, args.output_len, vocab_size=args.vocab_size
    )
    results, duration = asyncio.run(
        run_benchmark(
            f"http://127.0.0.1:{args.port}", args.model, requests,
            max_concurrency=args.concurrency,
        )
    )  # fmt: skip
    summary = summarize(results, duration)
    # A rare ReadError is a keep-alive race (the server closes an idle connection as the client
    # reuses it), not the server's fault; more than that is.
    if summary["failed"] > len(requests) // 100:
        raise RuntimeError(f"{summary['failed']} requests failed: {summary['errors']}")
    return summary


def measure(args: argparse.Namespace, profile_out: str | None) -> dict[str, object]:
    """One server, a warm-up load, then the measured load."""
    command = [sys.executable, __file__, "--serve", "--port", str(args.port),
               "--model", args.model, "--tokenizer", args.tokenizer,
               "--max-num-seqs", str(args.max_num_seqs), "--vocab-size", str(args.vocab_size),
               "--profile-out", profile_out or os.devnull]  # fmt: skip
    server = subprocess.Popen(command)
    try:
        wait_until_up(args.port, server)
        warm = argparse.Namespace(**{**vars(args), "num_prompts": args.concurrency})
        load(warm)
        if profile_out:
            server.send_signal(signal.SIGUSR1)
            time.sleep(0.2)
        cpu_before = cpu_seconds(server.pid)
        summary = load(args)
        cpu = cpu_seconds(server.pid) - cpu_before
        if profile_out:
            server.send_signal(signal.SIGUSR2)
            time.sleep(2.0)  # the dump
    finally:
        server.send_signal(signal.SIGINT)
        server.wait(60)
    num_tokens = summary["total_output_tokens"]
    row: dict[str, object] = {
        "cpu_us_per_token": round(cpu / num_tokens * 1e6, 1),
        "tpot_p50_ms": round(summary["tpot_ms"]["p50"], 2),
        "output_tokens_per_s": round(summary["output_token_throughput"], 1),
        "output_tokens": num_tokens,
        "failed_requests": summary["failed"],
    }
    if profile_out:
        own = buckets(profile_out)
        total = sum(own.values())
        per_token = row["cpu_us_per_token"]
        calls = pstats.Stats(profile_out).total_calls  # type: ignore[attr-defined]
        row["python_calls_per_token"] = round(calls / num_tokens, 1)
        row["profiled_share"] = {k: round(v / total, 3) for k, v in own.items()}
        row["us_per_token"] = {
            k: round(v / total * float(per_token), 1)  # type: ignore[arg-type]
            for k, v in own.items()
        }
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-tiny")
    parser.add_argument("--tokenizer", default="smollm2-135m")
    parser.add_argument(
        "--vocab-size", type=int, default=49152, help="the model's, = the tokenizer's (SmolLM2's)"
    )
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--port", type=int, default=8131)
    parser.add_argument("--profile", action="store_true", help="also a profiled run, by bucket")
    parser.add_argument("--top", type=int, default=0, help="print the N costliest functions")
    parser.add_argument("--output-json", default=None)
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--profile-out", default="/tmp/pieceworks_serve.prof")
    args = parser.parse_args()
    if args.serve:
        run_server(args)
        return
    row = measure(args, None)
    if args.profile:
        profiled = measure(args, args.profile_out)
        row["python_calls_per_token"] = profiled["python_calls_per_token"]
        row["profiled_share"] = profiled["profiled_share"]
        row["us_per_token"] = {
            k: round(share * float(row["cpu_us_per_token"]), 1)  # type: ignore[arg-type]
            for k, share in profiled["profiled_share"].items()  # type: ignore[attr-defined]
        }
        if args.top:
            pstats.Stats(args.profile_out).sort_stats("tottime").print_stats(args.top)
    print(json.dumps(row, indent=2))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(row, indent=2) + "\n")


if __name__ == "__main__":
    main()
