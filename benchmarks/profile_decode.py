"""Device profile of decode steps: where a step's time goes on the GPU, and how much is host gap.

Builds the engine for each mode, prefills ``--batch-size`` prompts of ``--input-len`` tokens, runs
a few decode steps to warm up, then records ``--steps`` decode steps under ``torch.profiler``
(CPU + CUDA activities). Prints and writes as JSON: wall ms per step, device-busy ms per step (the
union of kernel intervals), the idle share (host gaps the device waited for), and kernels grouped
by kind (GEMM, attention, Inductor-fused, copies, other) and by name. The Chrome trace is written
gzipped beside the JSON for a closer look (chrome://tracing or Perfetto).

    python benchmarks/profile_decode.py --model llama-3.1-8b --batch-size 1 \
        --modes piecewise,full_and_piecewise --out-dir prof
"""

from __future__ import annotations

import argparse
import gc
import gzip
import json
import random
import shutil
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pieceworks.benchmarks.device_busy import union_length  # noqa: E402
from pieceworks.benchmarks.modes import compilation_for_mode  # noqa: E402
from pieceworks.engine.llm import LLM  # noqa: E402
from pieceworks.platforms import current_platform  # noqa: E402
from pieceworks.sampling_params import SamplingParams  # noqa: E402


def kernel_kind(name: str) -> str:
    lowered = name.lower()
    if any(key in lowered for key in ("gemm", "gemv", "nvjet", "cutlass", "sm90_xmma", "splitk")):
        return "gemm"
    if any(key in lowered for key in ("attention", "paged", "reshape_and_cache", "kv_")):
        return "attention"
    if any(key in lowered for key in ("mamba", "ssd", "selective", "conv1d", "chunk_")):
        return "mamba"
    if lowered.startswith("triton_"):
        return "inductor_fused"
    if "memcpy" in lowered or "copy" in lowered or "memset" in lowered:
        return "copy"
    return "other"


def profile_mode(args: argparse.Namespace, mode: str) -> dict[str, Any]:
    llm = LLM(
        args.model,
        compilation_config=compilation_for_mode(mode, args.compilation_config),
        max_num_seqs=max(args.batch_size, 8),
        quantization=args.quantization,
        num_scheduler_steps=args.num_scheduler_steps,
    )
    engine = llm.engine
    rng = random.Random(0)
    vocab = llm.config.model_config.hf_config["vocab_size"]
    params = SamplingParams(temperature=0.0, max_tokens=args.steps * 3 + 16, ignore_eos=True)
    for _ in range(args.batch_size):
        engine.add_request([rng.randrange(vocab) for _ in range(args.input_len)], params)
    engine.step_seconds.clear()
    while not engine.step_seconds or not engine.step_seconds[-1][0]:  # until decode-only steps
        engine.step()
    calls = max(1, args.steps // args.num_scheduler_steps)  # each call runs K decode steps
    for _ in range(calls):
        engine.step()
    k = f"_k{args.num_scheduler_steps}" if args.num_scheduler_steps > 1 else ""
    trace_path = Path(args.out_dir) / f"trace_{mode}_b{args.batch_size}{k}.json"
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    engine.step_seconds.clear()
    with torch.profiler.profile(activities=activities) as profiler:
        start = time.perf_counter()
        for _ in range(calls):
            engine.step()
        wall = time.perf_counter() - start
    profiler.export_chrome_trace(str(trace_path))
    events = json.loads(trace_path.read_text())["traceEvents"]
    with open(trace_path, "rb") as raw, gzip.open(f"{trace_path}.gz", "wb") as packed:
        shutil.copyfileobj(raw, packed)
    trace_path.unlink()
    kernels = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    busy_us = union_length([(e["ts"], e["ts"] + e["dur"]) for e in kernels])
    by_kind: dict[str, float] = defaultdict(float)
    by_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for event in kernels:
        by_kind[kernel_kind(event["name"])] += event["dur"]
        by_name[event["name"]][0] += event["dur"]
        by_name[event["name"]][1] += 1
    steps = len(engine.step_seconds)  # decode steps run, K per call
    step_ms = [s * 1e3 for _, _, s in engine.step_seconds]
    result = {
        "mode": mode,
        "num_scheduler_steps": args.num_scheduler_steps,
        "wall_ms_per_step": wall * 1e3 / steps,
        "engine_step_ms": sorted(step_ms)[len(step_ms) // 2] if step_ms else None,
        "device_busy_ms_per_step": busy_us / 1e3 / steps,
        "kernel_ms_per_step": sum(e["dur"] for e in kernels) / 1e3 / steps,
        "kernels_per_step": len(kernels) / steps,
        "idle_share": 1 - busy_us / 1e3 / (wall * 1e3),
        "by_kind_ms_per_step": {k: v / 1e3 / steps for k, v in sorted(by_kind.items())},
        "top_kernels": [
            {
                "name": name[:120],
                "kind": kernel_kind(name),
                "ms_per_step": total / 1e3 / steps,
                "calls_per_step": count / steps,
                "us_per_call": total / count,
            }
            for name, (total, count) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:25]
        ],
    }
    print(
        f"== {mode}: wall {result['wall_ms_per_step']:.3f} ms/step, device busy "
        f"{result['device_busy_ms_per_step']:.3f} ms, idle {result['idle_share']:.1%}, "
        f"{result['kernels_per_step']:.0f} kernels/step",
        flush=True,
    )
    for kind, ms in result["by_kind_ms_per_step"].items():
        print(f"   {kind:15s} {ms:8.3f} ms/step")
    for row in result["top_kernels"][:15]:
        print(
            f"   {row['ms_per_step']:8.3f} ms {row['calls_per_step']:6.0f}x "
            f"{row['us_per_call']:8.1f} us  {row['name'][:90]}"
        )
    llm.shutdown()
    del llm, engine
    gc.collect()
    current_platform().empty_cache()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-3.1-8b")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--modes", default="piecewise,full_and_piecewise")
    parser.add_argument("--quantization", default=None)
    parser.add_argument(
        "--num-scheduler-steps", type=int, default=1, help="decode steps per host round trip (K)"
    )
    parser.add_argument(
        "--compilation-config", type=json.loads, default=None, help="CompilationConfig fields"
    )
    parser.add_argument("--out-dir", default="prof")
    args = parser.parse_args()
    Path(args.out_dir).mkdir(parents=True, exist_ok=True)
    results = [profile_mode(args, mode) for mode in args.modes.split(",")]
    report = {
        "model": args.model,
        "batch_size": args.batch_size,
        "input_len": args.input_len,
        "quantization": args.quantization,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "results": results,
    }
    k = f"_k{args.num_scheduler_steps}" if args.num_scheduler_steps > 1 else ""
    out = Path(args.out_dir) / f"profile_{args.model}_b{args.batch_size}{k}.json"
    out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
