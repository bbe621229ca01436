"""Localise a tensor-parallel hang: run ``LLM(tensor_parallel_size=N)`` in several configurations,
each in its own process group under a time limit; on timeout every rank's Python stacks are dumped
(``PYTHONFAULTHANDLER`` + SIGABRT to the group) before the group is killed.

Usage: python benchmarks/tp_probe.py [--model llama-125m] [--tp 2] [--timeout 150]
           [--configs full_and_piecewise:async,eager:sync,...] [--only-if-first-fails]
A configuration is ``<mode>:<async|sync>``; one JSON line per configuration goes to stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time


def child(model: str, tp: int, mode: str, async_scheduling: bool) -> None:
    """One engine: three greedy prompts, tokens and phase times as one JSON line."""
    import torch

    from pieceworks.engine.llm import LLM
    from pieceworks.engine.modes import compilation_for_mode
    from pieceworks.engine.sampling_params import SamplingParams

    start = time.perf_counter()
    llm = LLM(
        model,
        compilation_config=compilation_for_mode(mode),
        dtype="float32",
        max_num_seqs=8,
        tensor_parallel_size=tp,
        async_scheduling=async_scheduling,
    )
    built = time.perf_counter()
    print(f"[probe] engine up in {built - start:.1f} s", file=sys.stderr, flush=True)
    vocab = llm.config.model_config.hf_config["vocab_size"]
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in (5, 17, 33)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    tokens = [out.outputs[0].token_ids for out in llm.generate(prompts, params)]
    generated = time.perf_counter()
    llm.shutdown()
    print(
        json.dumps(
            {
                "start_s": round(built - start, 1),
                "generate_s": round(generated - built, 2),
                "shutdown_s": round(time.perf_counter() - generated, 1),
                "tokens": tokens,
            }
        ),
        flush=True,
    )


def probe(args: argparse.Namespace, config: str) -> dict:
    mode, scheduling = config.split(":")
    env = dict(os.environ, PYTHONFAULTHANDLER="1")
    command = [
        sys.executable,
        __file__,
        "--child",
        "--model",
        args.model,
        "--tp",
        str(args.tp),
        "--configs",
        config,
    ]
    started = time.perf_counter()
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, start_new_session=True)
    try:
        stdout, _ = process.communicate(timeout=args.timeout)
        result = {"config": config, "rc": process.returncode}
        lines = [line for line in stdout.decode().splitlines() if line.startswith("{")]
        if lines:
            result.update(json.loads(lines[-1]))
    except subprocess.TimeoutExpired:
        print(
            f"[probe] {config}: no end after {args.timeout} s; dumping every rank's stacks",
            file=sys.stderr,
            flush=True,
        )
        os.killpg(process.pid, signal.SIGABRT)
        time.sleep(5)
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        result = {"config": config, "rc": "timeout"}
    result["wall_s"] = round(time.perf_counter() - started, 1)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama-125m")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=150)
    parser.add_argument("--configs", default="full_and_piecewise:async")
    parser.add_argument(
        "--only-if-first-fails",
        action="store_true",
        help="run the other configurations only when the first one fails",
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        mode, scheduling = args.configs.split(":")
        child(args.model, args.tp, mode, scheduling == "async")
        return
    for index, config in enumerate(args.configs.split(",")):
        result = probe(args, config)
        print(json.dumps(result), flush=True)
        if index == 0 and args.only_if_first_fails and result["rc"] == 0:
            break


if __name__ == "__main__":
    main()
