"""Probe: the persistent ring FP8 GEMV against the Triton GEMV at the 8B MLP and o_proj shapes.

One CUDA graph holds 32 layers, each with its own weights (nothing stays in L2). Rows:
- ``single``: [producer, GEMV] per layer for down_proj (4096 x 14336), gate_up_proj (gated, 28672
  x 4096, FP8 output) and o_proj (4096 x 4096, also the resident GEMV). The producer is a spin
  kernel that releases the GEMV at its start (PDL), spins ``--delays-ns`` and writes x; the time
  per layer minus the producer-only graph's is what the GEMV adds after it.
- ``mlp``: [producer, gate_up, down] per layer, the MLP after its norm kernel (the producer
  spins ``--mlp-delay-ns``, about a norm kernel), Triton GEMVs against ring GEMVs.

Run (Hopper GPU): PYTHONPATH=. python benchmarks/ring_gemv_probe.py --out probe.json
"""

import argparse
import functools
import json

import torch
from gemv_decode import graph_time_us
from resident_gemv_probe import spin_then_write

from pieceworks.core.norm_quant import FP8_DTYPE
from pieceworks.models.layers.resident_gemv import launch_resident_gemv
from pieceworks.models.layers.ring_gemv import launch_ring_gemv
from pieceworks.models.layers.triton_gemv import launch_gemv

SHAPES = {"down": (4096, 14336), "gate_up": (28672, 4096), "o_proj": (4096, 4096)}


def gemvs(shape_name: str, scale: torch.Tensor) -> dict:
    bf16, scales = torch.bfloat16, (scale, scale)
    if shape_name == "gate_up":
        return {
            "triton": lambda x, w: launch_gemv(
                x, w, scales=scales, out_dtype=bf16, gated=True, out_scale=scale
            ),
            "ring": lambda x, w: launch_ring_gemv(x, w, scales, bf16, gated=True, out_scale=scale),
        }
    found = {
        "triton": lambda x, w: launch_gemv(x, w, scales=scales, out_dtype=bf16),
        "ring": lambda x, w: launch_ring_gemv(x, w, scales, bf16),
    }
    if shape_name == "o_proj":
        found["resident"] = lambda x, w: launch_resident_gemv(x, w, scales, bf16)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--delays-ns", type=int, nargs="+", default=[0, 2500])
    parser.add_argument("--mlp-delay-ns", type=int, default=2000)
    parser.add_argument("--num-tokens", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--replays", type=int, default=30)
    args = parser.parse_args()
    scale = torch.tensor(1.0, device="cuda")
    weights = {
        name: [(torch.randn(n, k, device="cuda") / 4).to(FP8_DTYPE) for _ in range(args.layers)]
        for name, (n, k) in SHAPES.items()
    }
    rows = []

    def save() -> None:
        with open(args.out, "w") as f:
            json.dump(dict(rows=rows), f, indent=2)

    for num_tokens in args.num_tokens:
        for name, (_, k) in SHAPES.items():
            source = torch.randn(num_tokens, k, device="cuda").to(FP8_DTYPE)
            xs = [torch.empty_like(source) for _ in range(args.layers)]
            for delay_ns in args.delays_ns:
                spins = [functools.partial(spin_then_write, source, x, delay_ns) for x in xs]
                spin_us = graph_time_us(spins, args.replays)
                row = dict(kind="single", shape=name, num_tokens=num_tokens, delay_ns=delay_ns,
                           spin_us=spin_us)  # fmt: skip
                for gemv_name, gemv in gemvs(name, scale).items():
                    layer = [
                        step
                        for x, w, spin in zip(xs, weights[name], spins)
                        for step in (spin, functools.partial(gemv, x, w))
                    ]
                    per_layer = graph_time_us(layer, args.replays) * 2  # per call: 2 per layer
                    row[f"{gemv_name}_after_spin_us"] = per_layer - spin_us
                rows.append(row)
                save()
                print(json.dumps(row), flush=True)
        source = torch.randn(num_tokens, 4096, device="cuda").to(FP8_DTYPE)
        xs = [torch.empty_like(source) for _ in range(args.layers)]
        spins = [functools.partial(spin_then_write, source, x, args.mlp_delay_ns) for x in xs]
        spin_us = graph_time_us(spins, args.replays)
        row = dict(kind="mlp", num_tokens=num_tokens, delay_ns=args.mlp_delay_ns, spin_us=spin_us)
        for gemv_name in ("triton", "ring"):
            gate_up, down = gemvs("gate_up", scale)[gemv_name], gemvs("down", scale)[gemv_name]
            layer = []
            for x, spin, w1, w2 in zip(xs, spins, weights["gate_up"], weights["down"]):
                hidden = []
                layer += [
                    spin,
                    lambda x=x, w1=w1, hidden=hidden, f=gate_up: hidden.append(f(x, w1)),
                    lambda w2=w2, hidden=hidden, f=down: f(hidden[-1], w2),
                ]
            per_layer = graph_time_us(layer, args.replays) * 3
            row[f"{gemv_name}_mlp_after_spin_us"] = per_layer - spin_us
        rows.append(row)
        save()
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
