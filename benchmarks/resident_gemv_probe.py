"""Probe: the resident-weight FP8 GEMV against the Triton GEMV after a latency-bound kernel.

In a decode step ``o_proj`` follows decode attention, whose split and reduce kernels leave HBM
idle for several microseconds. This probe stands a spin kernel in for them: under PDL it lets the
next kernel be scheduled at its start, spins ``--delays-ns``, then writes x (FP8, one to eight
tokens). One CUDA graph holds 32 layers of [spin, o_proj] with a distinct 4096 x 4096 FP8 weight
each (nothing stays in L2); the time per layer minus the spin-only graph's is what o_proj adds
after its producer. The Triton GEMV waits before its first load; the resident GEMV copies most of
its weight slice into shared memory before it waits (``models/layers/resident_gemv.py``).

Run (Hopper GPU): PYTHONPATH=. python benchmarks/resident_gemv_probe.py --out probe.json
"""

import argparse
import functools
import json

import torch
import triton
import triton.language as tl
from gemv_decode import graph_time_us

from pieceworks.core.norm_quant import FP8_DTYPE
from pieceworks.models.layers.resident_gemv import launch_resident_gemv, uses_resident_gemv
from pieceworks.models.layers.triton_gemv import launch_gemv
from pieceworks.models.layers.triton_launch import launch_options, programmatic_launch


@triton.jit
def _spin_then_write(source_ptr, x_ptr, num_elements, delay_ns, BLOCK: tl.constexpr):
    tl.extra.cuda.gdc_launch_dependents()  # the GEMV may be scheduled now
    tl.extra.cuda.gdc_wait()
    start = _global_time_ns()
    while _global_time_ns() - start < delay_ns:
        pass
    for offset in range(0, num_elements, BLOCK):
        index = offset + tl.arange(0, BLOCK)
        mask = index < num_elements
        tl.store(x_ptr + index, tl.load(source_ptr + index, mask=mask), mask=mask)


@triton.jit
def _global_time_ns():
    return tl.inline_asm_elementwise(
        "mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1
    )


def spin_then_write(source: torch.Tensor, x: torch.Tensor, delay_ns: int) -> None:
    pdl = programmatic_launch(x.device)
    _spin_then_write[(1,)](source, x, x.numel(), delay_ns, BLOCK=1024, **launch_options(pdl))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--delays-ns", type=int, nargs="+", default=[0, 4000, 8000])
    parser.add_argument("--num-tokens", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--replays", type=int, default=50)
    args = parser.parse_args()
    scale = torch.tensor(1.0, device="cuda")
    weights = [
        (torch.randn(4096, 4096, device="cuda") / 4).to(FP8_DTYPE) for _ in range(args.layers)
    ]
    bf16, scales = torch.bfloat16, (scale, scale)
    gemvs = {
        "triton": lambda x, w: launch_gemv(x, w, scales=scales, out_dtype=bf16),
        "resident": lambda x, w: launch_resident_gemv(x, w, scales, bf16),
    }
    rows = []
    for num_tokens in args.num_tokens:
        source = (torch.randn(num_tokens, 4096, device="cuda")).to(FP8_DTYPE)
        xs = [torch.empty_like(source) for _ in range(args.layers)]
        assert uses_resident_gemv(xs[0], weights[0])
        for delay_ns in args.delays_ns:
            spins = [functools.partial(spin_then_write, source, x, delay_ns) for x in xs]
            spin_us = graph_time_us(spins, args.replays)
            row = dict(num_tokens=num_tokens, delay_ns=delay_ns, spin_us=spin_us)
            for name, gemv in gemvs.items():
                layer = [
                    step
                    for x, w, spin in zip(xs, weights, spins)
                    for step in (spin, functools.partial(gemv, x, w))
                ]
                per_layer = graph_time_us(layer, args.replays) * 2  # graph_time_us: per call
                row[f"{name}_layer_us"] = per_layer
                row[f"{name}_after_spin_us"] = per_layer - spin_us
            rows.append(row)
            print(
                f"tokens {num_tokens} spin {delay_ns / 1000:4.1f} us ({spin_us:5.2f} alone) | "
                f"o_proj after it: triton {row['triton_after_spin_us']:5.2f} us, "
                f"resident {row['resident_after_spin_us']:5.2f} us",
                flush=True,
            )
    check = launch_resident_gemv(xs[0], weights[0], (scale, scale), torch.float32)
    expected = launch_gemv(xs[0], weights[0], scales=(scale, scale), out_dtype=torch.float32)
    error = ((check - expected).abs().max() / expected.abs().max()).item()
    print(f"resident against triton: max error {error:.1e} of the largest output")
    with open(args.out, "w") as f:
        json.dump(dict(rows=rows, max_relative_difference=error), f, indent=2)


if __name__ == "__main__":
    main()
