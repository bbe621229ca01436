"""Micro-benchmark: the FP8 norm split against GEMV + fused norm kernel + GEMV, 8B shapes.

One decoder layer's MLP half and the step into the next layer's attention, as a decode graph runs
them at batch 1 (``--num-tokens``): unsplit, ``o_proj`` GEMV -> fused add + RMSNorm + FP8 quant
kernel -> gate_up GEMV (SiLU-and-mul, FP8 out) -> ``down_proj`` GEMV -> fused norm -> qkv GEMV
(rotary); split, the same with each norm inside the GEMVs around it
(``quantization/fp8_norm_split.py``). Each chain runs over ``--layers`` distinct weight sets (so
no weight stays in L2) inside one CUDA graph; reported: µs per layer for each chain, and each
op alone (the same op over every layer's weights, in a graph) to say where a difference comes from.

Run (CUDA machine): python benchmarks/norm_split_probe.py --out norm_split.json
"""

import argparse
import json

import torch
from gemv_decode import graph_time_us  # benchmarks/ is on sys.path when run as a script

from pieceworks.core.norm_quant import FP8_DTYPE, static_scaled_fp8_quant
from pieceworks.models.layers.quantization import fp8, fp8_norm_split
from pieceworks.models.layers.quantization.triton_norm_quant import (
    fused_add_rms_norm_static_fp8_quant,
)

HIDDEN, INTERMEDIATE, HEAD_SIZE, NUM_HEADS, NUM_KV_HEADS = 4096, 14336, 128, 32, 8
EPS = 1e-5


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="path of the JSON results file")
    parser.add_argument("--num-tokens", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--layers", type=int, default=16, help="distinct weight sets per graph")
    parser.add_argument("--replays", type=int, default=50)
    return parser.parse_args()


def fp8_weight(out_features: int, in_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    weight = torch.randn(out_features, in_features, device="cuda", dtype=torch.bfloat16)
    return fp8.quantize_weight_per_tensor(weight / in_features**0.5)


def measure(num_tokens: int, layers: list[dict], scale, cos_sin, replays: int) -> dict:
    """One row: both chains per layer and each op alone, at ``num_tokens``."""
    dtype = torch.bfloat16
    attention_out = static_scaled_fp8_quant(torch.randn(num_tokens, HIDDEN, device="cuda"), scale)
    residual = torch.randn(num_tokens, HIDDEN, device="cuda", dtype=dtype)
    positions = torch.arange(num_tokens, device="cuda") + 1000
    rope = (positions, cos_sin, HEAD_SIZE, NUM_HEADS + NUM_KV_HEADS)

    def unsplit(layer):
        o = fp8.small_m_fp8_linear(
            attention_out, layer["o"][0], scale, layer["o"][1], None, dtype, True
        )
        x1 = torch.empty(o.shape, dtype=FP8_DTYPE, device="cuda")
        residual1 = torch.empty_like(o)
        fused_add_rms_norm_static_fp8_quant(x1, residual1, o, residual, layer["norm1"], scale, EPS)
        act = fp8.small_m_fp8_silu_and_mul(
            x1, layer["gate_up"][0], scale, layer["gate_up"][1], scale, dtype, True
        )
        d = fp8.small_m_fp8_linear(
            act, layer["down"][0], scale, layer["down"][1], None, dtype, True
        )
        x2 = torch.empty(d.shape, dtype=FP8_DTYPE, device="cuda")
        residual2 = torch.empty_like(d)
        fused_add_rms_norm_static_fp8_quant(x2, residual2, d, residual1, layer["norm2"], scale, EPS)
        return fp8.small_m_fp8_rope_linear(
            x2, layer["qkv"][0], scale, layer["qkv"][1], *rope, dtype, True
        )

    def split(layer):
        residual1, sums1, partials1 = fp8_norm_split.small_m_fp8_linear_add(
            attention_out, layer["o"][0], scale, layer["o"][1], residual, dtype, True
        )
        act = fp8_norm_split.small_m_fp8_normed_linear(
            sums1,
            partials1,
            layer["norm1"],
            EPS,
            layer["gate_up"][0],
            scale,
            layer["gate_up"][1],
            "silu_and_mul",
            scale,
            None,
            None,
            0,
            0,
            dtype,
            True,
        )
        residual2, sums2, partials2 = fp8_norm_split.small_m_fp8_linear_add(
            act, layer["down"][0], scale, layer["down"][1], residual1, dtype, True
        )
        return fp8_norm_split.small_m_fp8_normed_linear(
            sums2,
            partials2,
            layer["norm2"],
            EPS,
            layer["qkv"][0],
            scale,
            layer["qkv"][1],
            "rope",
            None,
            *rope,
            dtype,
            True,
        )

    expected, actual = unsplit(layers[0]), split(layers[0])
    error = float((actual.float() - expected.float()).norm() / expected.float().norm())
    row = {"num_tokens": num_tokens, "relative_error_qkv": error}
    for name, chain in (("unsplit", unsplit), ("split", split)):
        fns = [lambda layer=layer, chain=chain: chain(layer) for layer in layers]
        row[f"{name}_us_per_layer"] = graph_time_us(fns, replays)
    # each op alone, over every layer's weights
    x1 = static_scaled_fp8_quant(torch.randn(num_tokens, HIDDEN, device="cuda"), scale)
    act = static_scaled_fp8_quant(torch.randn(num_tokens, INTERMEDIATE, device="cuda"), scale)
    sums = torch.randn(num_tokens, HIDDEN, device="cuda")
    partials = (sums * sums).view(num_tokens, -1, 64).sum(-1)
    ops = {
        "o_gemv": lambda lay: fp8.small_m_fp8_linear(
            attention_out, lay["o"][0], scale, lay["o"][1], None, dtype, True
        ),
        "o_add": lambda lay: fp8_norm_split.small_m_fp8_linear_add(
            attention_out, lay["o"][0], scale, lay["o"][1], residual, dtype, True
        ),
        "norm": lambda lay: fused_add_rms_norm_static_fp8_quant(
            torch.empty_like(x1),
            torch.empty_like(residual),
            residual,
            residual,
            lay["norm1"],
            scale,
            EPS,
        ),
        "gate_up_gemv": lambda lay: fp8.small_m_fp8_silu_and_mul(
            x1, lay["gate_up"][0], scale, lay["gate_up"][1], scale, dtype, True
        ),
        "gate_up_normed": lambda lay: fp8_norm_split.small_m_fp8_normed_linear(
            sums,
            partials,
            lay["norm1"],
            EPS,
            lay["gate_up"][0],
            scale,
            lay["gate_up"][1],
            "silu_and_mul",
            scale,
            None,
            None,
            0,
            0,
            dtype,
            True,
        ),
        "down_gemv": lambda lay: fp8.small_m_fp8_linear(
            act, lay["down"][0], scale, lay["down"][1], None, dtype, True
        ),
        "down_add": lambda lay: fp8_norm_split.small_m_fp8_linear_add(
            act, lay["down"][0], scale, lay["down"][1], residual, dtype, True
        ),
        "qkv_gemv": lambda lay: fp8.small_m_fp8_rope_linear(
            x1, lay["qkv"][0], scale, lay["qkv"][1], *rope, dtype, True
        ),
        "qkv_normed": lambda lay: fp8_norm_split.small_m_fp8_normed_linear(
            sums,
            partials,
            lay["norm2"],
            EPS,
            lay["qkv"][0],
            scale,
            lay["qkv"][1],
            "rope",
            None,
            *rope,
            dtype,
            True,
        ),
    }
    for name, op in ops.items():
        fns = [lambda layer=layer, op=op: op(layer) for layer in layers]
        row[f"{name}_us"] = graph_time_us(fns, replays)
    return row


def main() -> None:
    args = parse_args()
    torch.manual_seed(0)
    qkv_rows = (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_SIZE
    layers = [
        {
            "o": fp8_weight(HIDDEN, HIDDEN),
            "gate_up": fp8_weight(2 * INTERMEDIATE, HIDDEN),
            "down": fp8_weight(HIDDEN, INTERMEDIATE),
            "qkv": fp8_weight(qkv_rows, HIDDEN),
            "norm1": 1 + 0.1 * torch.randn(HIDDEN, device="cuda", dtype=torch.bfloat16),
            "norm2": 1 + 0.1 * torch.randn(HIDDEN, device="cuda", dtype=torch.bfloat16),
        }
        for _ in range(args.layers)
    ]
    scale = torch.tensor(0.05, device="cuda")
    angles = torch.arange(4096, device="cuda")[:, None] * torch.linspace(
        1e-4, 1.0, HEAD_SIZE // 2, device="cuda"
    )
    cos_sin = torch.cat([angles.cos(), angles.sin()], dim=1).to(torch.bfloat16)
    rows = []
    for num_tokens in args.num_tokens:
        row = measure(num_tokens, layers, scale, cos_sin, args.replays)
        print(json.dumps(row), flush=True)
        rows.append(row)
    device = torch.cuda.get_device_name()
    with open(args.out, "w") as f:
        json.dump({"device": device, "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
