"""Probe: does pulling a weight into L2 while the GPU does latency-bound work speed up its GEMV?

At FP8 batch 1 an 8B decoder layer keeps HBM idle for about 14 us (rotary, split-KV attention,
its reduce, the output quant, launch gaps) right before ``o_proj`` reads 16.8 MB. This probe
measures, inside one CUDA graph replayed many times (16 distinct weights per shape, so nothing
stays in L2 from one product to the next; microseconds per product):

- ``gemv``: the FP8 GEMV alone;
- ``spin+gemv``: a one-program kernel that busy-waits ``--spin-us`` first (HBM idle);
- ``prefetch+spin+gemv``: a prefetch kernel (``prefetch.global.L2`` over the first
  ``fraction`` of W) before the spin: the gain over ``spin+gemv`` is what overlapping the weight
  stream with latency-bound work can give;
- ``prefetch+gemv`` and ``prefetch``: whether a prefetch kernel ends before its lines arrive.

Run (CUDA machine): PYTHONPATH=. python benchmarks/l2_prefetch_probe.py --out probe.json
(the session-6 numbers in docs/benchmarks.md came from commit df110a8, which timed the graph with
a copy of ``gemv_decode.graph_time_us``).
"""

import argparse
import json

import torch
import triton
import triton.language as tl
from gemv_decode import graph_time_us  # benchmarks/ is on sys.path when run as a script

from pieceworks.models.layers.triton_gemv import launch_gemv

SHAPES = {"qkv_proj": (6144, 4096), "o_proj": (4096, 4096), "gate_up_proj": (28672, 4096)}
LINES_PER_PROGRAM = 1024
L2_LINE_BYTES = 128  # what one prefetch instruction covers


@triton.jit
def prefetch_to_l2(pointers):
    """Prefetch the 128-byte line of each pointer into L2: a hint that never faults."""
    tl.inline_asm_elementwise(
        "prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;",
        "=r,l",
        [pointers],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def _prefetch_kernel(base_ptr, num_bytes, LINES: tl.constexpr, LINE_BYTES: tl.constexpr):
    offsets = (tl.program_id(0) * LINES + tl.arange(0, LINES)).to(tl.int64) * LINE_BYTES
    prefetch_to_l2(tl.where(offsets < num_bytes, base_ptr + offsets, base_ptr))


@triton.jit
def _spin_kernel(out_ptr, duration_ns):
    start = tl.inline_asm_elementwise(
        "mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1
    )
    now = start
    while now - start < duration_ns:
        now = tl.inline_asm_elementwise(
            "mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1
        )
    tl.store(out_ptr, now - start)


def prefetch(weight: torch.Tensor, fraction: float) -> None:
    num_bytes = int(weight.numel() * weight.element_size() * fraction)
    grid = (triton.cdiv(num_bytes, LINES_PER_PROGRAM * L2_LINE_BYTES),)
    _prefetch_kernel[grid](weight, num_bytes, LINES=LINES_PER_PROGRAM, LINE_BYTES=L2_LINE_BYTES)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--spin-us", type=float, default=10.0)
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.25, 0.5, 1.0])
    args = parser.parse_args()
    scale = torch.tensor(1.0, device="cuda")
    spin_out = torch.empty(1, dtype=torch.int64, device="cuda")
    spin_ns = int(args.spin_us * 1000)
    rows = []
    for name, (n, k) in SHAPES.items():
        x = torch.randn(1, k, device="cuda").to(torch.float8_e4m3fn)
        weights = [
            (torch.randn(n, k, device="cuda") * 0.05).to(torch.float8_e4m3fn) for _ in range(16)
        ]

        def gemv(w, x=x):
            return lambda: launch_gemv(x, w, scales=(scale, scale), out_dtype=torch.bfloat16)

        spin = lambda: _spin_kernel[(1,)](spin_out, spin_ns)  # noqa: E731
        cases = {
            "gemv": [gemv(w) for w in weights],
            "spin": [spin for _ in weights],
            "spin+gemv": [f for w in weights for f in (spin, gemv(w))],
        }
        for fraction in args.fractions:
            pre = lambda w, f=fraction: lambda: prefetch(w, f)  # noqa: E731
            cases[f"prefetch{fraction}"] = [pre(w) for w in weights]
            cases[f"prefetch{fraction}+gemv"] = [f for w in weights for f in (pre(w), gemv(w))]
            cases[f"prefetch{fraction}+spin+gemv"] = [
                f for w in weights for f in (pre(w), spin, gemv(w))
            ]
        for case, steps in cases.items():
            per_step = graph_time_us(steps, replays=50)
            per_product = per_step * len(steps) / len(weights)  # the whole sequence, per weight
            rows.append({"weight": name, "case": case, "us_per_product": round(per_product, 2)})
            print(f"{name:13s} {case:26s} {per_product:8.2f} us", flush=True)
        del weights
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
