"""Per-call host cost of a 32-layer toy model at each compile level and graph mode.

The toy is ``tests/core/toy_model.ToyModel`` (linear + split op per layer) at a tiny hidden size,
so device work is negligible and the time per call is the host overhead the pipeline removes:
eager (level 0), plain torch.compile (level 1, guards on every call), level 3 without graphs,
level 3 + PIECEWISE graphs, level 3 + FULL graph.

    python benchmarks/toy_overhead.py --layers 32 --tokens 8 --iters 200 --out toy.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pieceworks.config import EngineConfig, SchedulerConfig  # noqa: E402
from pieceworks.core.config import CompilationConfig, CUDAGraphMode  # noqa: E402
from pieceworks.core.forward_context import BatchDescriptor, set_forward_context  # noqa: E402
from pieceworks.platforms import current_platform  # noqa: E402
from tests.core.toy_model import SILLY_OP, ToyModel  # noqa: E402

CASES = [  # (name, level, graph mode)
    ("eager (level 0)", 0, CUDAGraphMode.NONE),
    ("torch.compile (level 1)", 1, CUDAGraphMode.NONE),
    ("level 3, no graphs", 3, CUDAGraphMode.NONE),
    ("level 3 + PIECEWISE", 3, CUDAGraphMode.PIECEWISE),
    ("level 3 + FULL", 3, CUDAGraphMode.FULL),
]


def build_runnable(level: int, mode: CUDAGraphMode, args: argparse.Namespace):
    compilation = CompilationConfig(
        level=level,
        backend=args.backend,
        splitting_ops=[SILLY_OP],
        cudagraph_mode=mode,
        cudagraph_capture_sizes=[args.tokens],
    )
    config = EngineConfig(
        scheduler_config=SchedulerConfig(max_num_seqs=args.tokens), compilation_config=compilation
    )
    platform = current_platform()
    model = ToyModel(config=config, num_layers=args.layers, hidden_size=args.hidden)
    model = model.to(platform.device()).requires_grad_(False)
    runnable = model
    if mode == CUDAGraphMode.FULL:
        runnable = platform.static_graph_wrapper_cls()(model, config, CUDAGraphMode.FULL)
    return config, runnable


def time_case(level: int, mode: CUDAGraphMode, args: argparse.Namespace) -> dict:
    platform = current_platform()
    config, runnable = build_runnable(level, mode, args)
    x = torch.randn(args.tokens, args.hidden, device=platform.device())
    descriptor = BatchDescriptor(args.tokens)
    runtime_mode = config.compilation_config.cudagraph_mode
    with torch.inference_mode():
        with set_forward_context(None, config):
            runnable(x)  # compile (mode NONE warm-up)
        samples = []
        with set_forward_context(
            None, config, cudagraph_runtime_mode=runtime_mode, batch_descriptor=descriptor
        ):
            for _ in range(args.warmup):
                runnable(x)
            platform.synchronize()
            for _ in range(args.repeats):
                start = time.perf_counter()
                for _ in range(args.iters):
                    runnable(x)
                platform.synchronize()
                samples.append((time.perf_counter() - start) / args.iters * 1e6)
    return {
        "us_per_call_median": statistics.median(samples),
        "us_per_call_min": min(samples),
        "us_per_call_max": max(samples),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--backend", default="inductor", choices=["inductor", "eager"])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    platform = current_platform()
    results = {
        "platform": platform.name,
        "device": platform.device_name(),
        "torch": torch.__version__,
        "layers": args.layers,
        "tokens": args.tokens,
        "backend": args.backend,
        "cases": {},
    }
    print(f"{'case':<26} {'us/call median':>15} {'min':>9} {'max':>9}")
    for name, level, mode in CASES:
        if mode != CUDAGraphMode.NONE and not platform.supports_static_graphs():
            continue
        result = time_case(level, mode, args)
        results["cases"][name] = result
        print(
            f"{name:<26} {result['us_per_call_median']:>15.1f} "
            f"{result['us_per_call_min']:>9.1f} {result['us_per_call_max']:>9.1f}",
            flush=True,
        )
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
