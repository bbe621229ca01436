"""Probe: the fused add + RMSNorm + FP8 quant kernel at one token, hardware against arithmetic
rounding, in a CUDA graph.

A decode step of the FP8 8B model runs 64 norm kernels of one program each (``docs/performance.md``,
session 8: 2.2 to 2.8 µs, where a chain of tiny one-program kernels costs 0.9 µs per launch). This
times ``--launches`` launches of the production kernel (``triton_norm_quant``: on a GPU its
roundings are hardware conversions) against a copy that rounds in float32 arithmetic (what every
GPU kernel did before), at 4, 8 and 16 warps, on distinct inputs per launch, and checks that both
write the same bytes.

Run (CUDA machine): python benchmarks/norm_kernel_probe.py --out norm_kernel.json
"""

import argparse
import functools
import json

import torch
import triton
import triton.language as tl
from gemv_decode import graph_time_us  # benchmarks/ is on sys.path when run as a script

from pieceworks.core.norm_quant import FP8_DTYPE, FP8_MAX
from pieceworks.models.layers.quantization.triton_norm_quant import _rms_norm_quant_kernel
from pieceworks.models.layers.triton_rounding import (
    round_to_bfloat16_bits,
    round_to_e4m3_arithmetic,
)

HIDDEN, EPS = 4096, 1e-5
REPLAYS = 50


@triton.jit
def _arithmetic_norm_kernel(
    input_ptr, residual_ptr, weight_ptr, scale_ptr, result_ptr, residual_out_ptr, hidden_size,
    epsilon, fp8_max, BLOCK_SIZE: tl.constexpr,
):  # fmt: skip
    # the production kernel's residual form (bfloat16 activations), its roundings in arithmetic
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_SIZE)
    mask = cols < hidden_size
    offsets = row * hidden_size + cols
    x = tl.load(input_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    x += tl.load(residual_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    tl.store(residual_out_ptr + offsets, round_to_bfloat16_bits(x).to(tl.bfloat16), mask=mask)
    variance = tl.sum(x * x, axis=0) / hidden_size
    normed = round_to_bfloat16_bits(x * tl.rsqrt(variance + epsilon))
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = round_to_bfloat16_bits(normed * weight)
    y = round_to_e4m3_arithmetic(y / tl.load(scale_ptr), fp8_max)
    tl.store(result_ptr + offsets, y.to(result_ptr.dtype.element_ty), mask=mask)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--launches", type=int, default=64)
    args = parser.parse_args()
    torch.manual_seed(0)
    num_launches = args.launches
    inputs = torch.randn(num_launches, 1, HIDDEN, device="cuda", dtype=torch.bfloat16)
    residuals = torch.randn(num_launches, 1, HIDDEN, device="cuda", dtype=torch.bfloat16)
    weight = (1 + 0.1 * torch.randn(HIDDEN, device="cuda")).to(torch.bfloat16)
    scale = torch.tensor(0.02, device="cuda")
    results = torch.empty(num_launches, 1, HIDDEN, device="cuda", dtype=FP8_DTYPE)
    residual_outs = torch.empty_like(inputs)
    block = triton.next_power_of_2(HIDDEN)

    def production(warps: int) -> list:
        return [
            functools.partial(
                _rms_norm_quant_kernel[(1,)], inputs[i], residuals[i], weight, scale, results[i],
                residual_outs[i], HIDDEN, EPS, FP8_MAX, BLOCK_SIZE=block, HAS_RESIDUAL=True,
                PDL=False, num_warps=warps,
            )
            for i in range(num_launches)
        ]  # fmt: skip

    def arithmetic(warps: int) -> list:
        return [
            functools.partial(
                _arithmetic_norm_kernel[(1,)], inputs[i], residuals[i], weight, scale, results[i],
                residual_outs[i], HIDDEN, EPS, FP8_MAX, BLOCK_SIZE=block, num_warps=warps,
            )
            for i in range(num_launches)
        ]  # fmt: skip

    def run(launches: list) -> None:
        for launch in launches:
            launch()

    rows = []
    for warps in (4, 8, 16):
        run(production(warps))
        expected = results.clone(), residual_outs.clone()
        run(arithmetic(warps))
        same = torch.equal(results.view(torch.uint8), expected[0].view(torch.uint8)) and (
            torch.equal(residual_outs, expected[1])
        )
        row = {
            "warps": warps,
            "hardware_us": graph_time_us(production(warps), REPLAYS),
            "arithmetic_us": graph_time_us(arithmetic(warps), REPLAYS),
            "same_bytes": same,
        }
        print(json.dumps(row), flush=True)
        rows.append(row)
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
