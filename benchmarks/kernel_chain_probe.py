"""Probe: what one kernel of a dependent chain costs in a CUDA graph when it moves almost nothing.

A decode step of the FP8 8B model is 272 kernels in a row, each reading what the one before wrote
(``docs/performance.md``). This replays graphs of ``--kernels`` launches of a tiny Triton kernel
in which every launch reads the buffer the previous one wrote (4 KB per program) and writes the
other, for 1, 132 and 528 programs per launch, and a store-only kernel (no dependent read) at 132
programs; it reports µs per launch. That time times the number of kernels is the part of a step
that no kernel, however fast, removes while the kernels run one after another.

Run (CUDA machine): python benchmarks/kernel_chain_probe.py --out kernel_chain.json
"""

import argparse
import functools
import json

import torch
import triton
import triton.language as tl
from gemv_decode import graph_time_us  # benchmarks/ is on sys.path when run as a script

BLOCK = 1024  # float32 per program: 4 KB


@triton.jit
def _hop_kernel(src_ptr, dst_ptr, READ: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    value = tl.load(src_ptr + offsets) + 1.0 if READ else offsets.to(tl.float32)
    tl.store(dst_ptr + offsets, value)


def per_launch_us(num_programs: int, read: bool, kernels: int, replays: int) -> float:
    buffers = [torch.zeros(num_programs * BLOCK, device="cuda") for _ in range(2)]
    launch = _hop_kernel[(num_programs,)]
    fns = [  # launch i reads what launch i - 1 wrote
        functools.partial(launch, buffers[i % 2], buffers[1 - i % 2], READ=read, BLOCK=BLOCK)
        for i in range(kernels)
    ]
    return graph_time_us(fns, replays)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--kernels", type=int, default=272)
    parser.add_argument("--replays", type=int, default=50)
    args = parser.parse_args()
    rows = []
    for num_programs, read in ((1, True), (132, True), (528, True), (132, False)):
        us = per_launch_us(num_programs, read, args.kernels, args.replays)
        rows.append({"programs": num_programs, "dependent_read": read, "us_per_launch": us})
        print(f"{num_programs:4d} programs, read={read}: {us:.2f} us per launch", flush=True)
    result = {"device": torch.cuda.get_device_name(), "kernels": args.kernels, "rows": rows}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
