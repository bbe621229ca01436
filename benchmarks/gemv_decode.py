"""Micro-benchmark: the small-M Triton GEMV against F.linear (cuBLAS) on decode shapes.

Two measurements. The one that decides (``graph``): per shape and token count, 32 distinct
weights (one per layer, so nothing stays in L2) multiplied in turn inside one CUDA graph, the
graph replayed; time per product, as a decode step's graph runs them. The kernel's default
config (``gemv_config``) against ``F.linear``, also at 32 and 64 tokens (``small_m_linear``
routes up to 64 only for small weights, ``max_gemv_tokens``; the 8B shapes' batch-64 products
are cuBLAS's, at about 84% of the copy bandwidth), for the Llama-3.1-8B layers or, with
``--model``, those of other models; gate_up also as the gated GEMV against cuBLAS followed by
the activation kernel. Then, with ``--sweep`` (slow): for each weight
(N, K) of an 8B layer and each token count M, times ``F.linear`` and ``launch_gemv`` with the
default launch config and a sweep of others (median of ``triton.testing.do_bench``, L2 flushed
before every run: the flush's write-backs make every time longer than in a graph, so compare
configs there, not absolute speeds). Reports TB/s (weight bytes / time: a GEMV must read W once)
and each config's max relative error against ``F.linear``. ``--fp8`` instead times the FP8 GEMV
(e4m3 operands, per-tensor scales) against cuBLAS ``_scaled_mm`` in the graph, the gated gate_up
GEMV (SiLU-and-mul and the FP8 quant as its epilogue), and at one token a tile and stage sweep.

Run (CUDA machine): PYTHONPATH=. python benchmarks/gemv_decode.py --out gemv.json
"""

import argparse
import dataclasses
import functools
import itertools
import json

import torch
import torch.nn.functional as F

GRAPH_TILES = [(16, 256), (32, 256), (64, 256), (32, 512), (64, 128), (128, 128)]
SHAPES = {  # (N, K) of the Llama-3.1-8B linear layers at tensor-parallel size 1
    "qkv_proj": (6144, 4096),
    "o_proj": (4096, 4096),
    "gate_up_proj": (28672, 4096),
    "down_proj": (4096, 14336),
}
MODEL_SHAPES = {  # --model: the (N, K) of other models' linear layers, for the graph rows
    "llama-3.1-8b": SHAPES,
    "llama-3.2-1b": {
        "qkv_proj": (3072, 2048),
        "o_proj": (2048, 2048),
        "gate_up_proj": (16384, 2048),
        "down_proj": (2048, 8192),
    },
    "qwen3-8b": {
        "qkv_proj": (6144, 4096),
        "o_proj": (4096, 4096),
        "gate_up_proj": (24576, 4096),
        "down_proj": (4096, 12288),
    },
    "gemma-3-4b": {
        "qkv_proj": (4096, 2560),
        "o_proj": (2560, 2048),
        "gate_up_proj": (20480, 2560),
        "down_proj": (2560, 10240),
    },
    "smollm2-360m": {
        "qkv_proj": (1600, 960),
        "o_proj": (960, 960),
        "gate_up_proj": (5120, 960),
        "down_proj": (960, 2560),
    },
    "llama-125m": {
        "qkv_proj": (2304, 768),
        "o_proj": (768, 768),
        "gate_up_proj": (6144, 768),
        "down_proj": (768, 3072),
    },
    "smollm2-135m": {
        "qkv_proj": (960, 576),
        "o_proj": (576, 576),
        "gate_up_proj": (3072, 576),
        "down_proj": (576, 1536),
    },
}

FP8_TILES = [(64, 512), (32, 1024), (64, 256), (128, 256), (32, 512), (16, 1024)]
FP8_STAGES = [3, 4, 6]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="path of the JSON results file")
    parser.add_argument("--num-tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    parser.add_argument(
        "--model",
        nargs="+",
        default=["llama-3.1-8b"],
        choices=list(MODEL_SHAPES),
        help="whose linear layers the graph rows time",
    )
    parser.add_argument("--block-n", type=int, nargs="+", default=[16, 32, 64])
    parser.add_argument("--block-k", type=int, nargs="+", default=[128, 256, 512])
    parser.add_argument(
        "--warps-stages",
        nargs="+",
        default=["4x3", "4x4", "8x4"],
        help="num_warps x num_stages pairs to sweep",
    )
    parser.add_argument("--rep-ms", type=int, default=50, help="do_bench repetition time")
    parser.add_argument("--sweep", action="store_true", help="also the do_bench config sweep")
    parser.add_argument("--graph-layers", type=int, default=32, help="distinct weights per graph")
    parser.add_argument("--graph-replays", type=int, default=20)
    parser.add_argument(
        "--graph-stages", type=int, nargs="+", default=[4], help="stages of the graph tile sweep"
    )
    parser.add_argument("--fp8", action="store_true", help="only the FP8 GEMV rows")
    parser.add_argument("--fp8-tokens", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument(
        "--fp8-tiles",
        nargs="+",
        default=FP8_TILES,
        type=lambda tile: tuple(int(v) for v in tile.split("x")),
        help="FP8 sweep tiles, block_n x block_k (bytes of K)",
    )
    parser.add_argument("--fp8-stages", type=int, nargs="+", default=FP8_STAGES)
    parser.add_argument(
        "--layers", nargs="+", default=list(SHAPES), choices=list(SHAPES), help="FP8 rows only"
    )
    parser.add_argument("--copy-tbps", type=float, default=4.1, help="bandwidth for the floor")
    return parser.parse_args()


def graph_time_us(fns: list, replays: int) -> float:
    """Per-call device time of ``fns``, called in turn inside one CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in fns:  # warm-up outside the graph: compiles, picks the cuBLAS kernel
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (replays * len(fns))


def linear_then_activation(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of a merged [gate; up] weight as two kernels: cuBLAS, then the
    activation (what the gated op runs for a token count the GEMV does not take)."""
    from pieceworks.kernels.gemv.triton_gemv import silu_and_mul_epilogue

    return silu_and_mul_epilogue(F.linear(x, weight), None)


def graph_rows(args) -> list[dict]:
    """F.linear against the default GEMV config, in graphs of one product per layer; for
    gate_up also the gated GEMV (silu(gate) * up in its epilogue) against F.linear followed by
    the activation kernel, the path of a token count the GEMV does not take."""
    from pieceworks.kernels.gemv.triton_gemv import (
        GemvConfig,
        gemv_config,
        launch_gemv,
        max_shared_bytes,
    )

    rows = []
    shapes = [(model, *layer) for model in args.model for layer in MODEL_SHAPES[model].items()]
    for (model, name, (n, k)), m in itertools.product(shapes, args.num_tokens):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        weights = [
            torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
            for _ in range(args.graph_layers)
        ]
        weight_bytes = n * k * 2
        linear_us = graph_time_us(
            [functools.partial(F.linear, x, weight) for weight in weights], args.graph_replays
        )
        gemv_us = graph_time_us(
            [functools.partial(launch_gemv, x, weight) for weight in weights], args.graph_replays
        )
        gated = {}
        if name == "gate_up_proj":
            gated["unfused_us"] = graph_time_us(
                [functools.partial(linear_then_activation, x, weight) for weight in weights],
                args.graph_replays,
            )
            gated["gated_gemv_us"] = graph_time_us(
                [functools.partial(launch_gemv, x, weight, gated=True) for weight in weights],
                args.graph_replays,
            )
        sweep = {}
        if m == 1:  # a few tiles in the graph too: the do_bench sweep's ranking may not hold
            for (block_n, block_k), stages in itertools.product(GRAPH_TILES, args.graph_stages):
                config = GemvConfig(block_n=block_n, block_k=block_k, num_stages=stages)
                fns = [functools.partial(launch_gemv, x, weight, config) for weight in weights]
                tile = f"{block_n}x{block_k}" + (f"x{stages}" if stages != 4 else "")
                try:
                    sweep[tile] = graph_time_us(fns, args.graph_replays)
                except Exception as exc:  # e.g. triton's OutOfResources: too big for the SM
                    print(f"graph {name:>12} m= 1 tile {tile}: skipped ({type(exc).__name__})")
            print(f"graph {name:>12} m= 1 tiles: " + ", ".join(
                f"{tile} {us:.1f} us" for tile, us in sweep.items()))  # fmt: skip
        error = max_relative_error(launch_gemv(x, weights[0]), F.linear(x, weights[0]))
        row = dict(
            model=model, layer=name, n=n, k=k, m=m, weight_bytes=weight_bytes, **gated,
            config=vars(gemv_config(m, n, k, 2, max_shared_bytes(x.device))),
            linear_us=linear_us, linear_tbps=weight_bytes / linear_us / 1e6,
            gemv_us=gemv_us, gemv_tbps=weight_bytes / gemv_us / 1e6, max_rel_err=error,
            tile_sweep_us=sweep,
        )  # fmt: skip
        print(
            f"graph {model} {name:>12} m={m:>2} linear {linear_us:6.1f} us"
            f" {row['linear_tbps']:4.2f} TB/s | gemv {gemv_us:6.1f} us {row['gemv_tbps']:4.2f} TB/s"
            f" | rel err {error:.1e}" + "".join(f" | {key} {us:.1f}" for key, us in gated.items())
        )
        rows.append(row)
        del weights
        torch.cuda.empty_cache()
    return rows


def fp8_rows(args) -> list[dict]:
    """FP8 (e4m3, per-tensor scales): cuBLAS ``_scaled_mm`` against the GEMV, in graphs of one
    product per layer; gate_up also as the gated GEMV (silu(gate) * up and the FP8 quant of the
    result in its epilogue), and bfloat16 gate_up gated against plain. At m = 1, a tile and
    stage sweep of the FP8 GEMV."""
    from pieceworks.kernels.gemv.triton_gemv import GemvConfig, gemv_config, launch_gemv

    fp8 = torch.float8_e4m3fn
    scale = torch.tensor(1.0, device="cuda")
    rows = []
    shapes = {name: SHAPES[name] for name in args.layers}
    for (name, (n, k)), m in itertools.product(shapes.items(), args.fp8_tokens):
        x = torch.randn(m, k, device="cuda").to(fp8)
        weights = [
            (torch.randn(n, k, device="cuda") / k**0.5 * 64).to(fp8)
            for _ in range(args.graph_layers)
        ]
        scaled_mm = [
            functools.partial(
                torch._scaled_mm, x, w.t(), scale_a=scale, scale_b=scale, out_dtype=torch.bfloat16
            )
            for w in weights
        ]
        kwargs = dict(scales=(scale, scale), out_dtype=torch.bfloat16)
        gemv = [functools.partial(launch_gemv, x, w, **kwargs) for w in weights]
        row = dict(layer=name, n=n, k=k, m=m, weight_bytes=n * k)
        row["config"] = vars(gemv_config(m, n, k, 1))
        row["scaled_mm_us"] = graph_time_us(scaled_mm, args.graph_replays)
        row["gemv_us"] = graph_time_us(gemv, args.graph_replays)
        reference = torch._scaled_mm(
            x, weights[0].t(), scale_a=scale, scale_b=scale, out_dtype=torch.float32
        )
        row["max_rel_err"] = max_relative_error(gemv[0]().float(), reference)
        if name == "gate_up_proj":
            gated = [
                functools.partial(launch_gemv, x, w, gated=True, out_scale=scale, **kwargs)
                for w in weights
            ]
            row["gated_gemv_us"] = graph_time_us(gated, args.graph_replays)
            row["gated_config"] = vars(gemv_config(m, n, k, 1, None, True))
            x16 = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            w16 = [w.to(torch.bfloat16) for w in weights]
            row["bf16_gemv_us"] = graph_time_us(
                [functools.partial(launch_gemv, x16, w) for w in w16], args.graph_replays
            )
            row["bf16_gated_gemv_us"] = graph_time_us(
                [functools.partial(launch_gemv, x16, w, gated=True) for w in w16],
                args.graph_replays,
            )
            del w16
        if m == 1:
            sweep = {}
            for (block_n, block_k), stages in itertools.product(args.fp8_tiles, args.fp8_stages):
                config = GemvConfig(block_n=block_n, block_k=block_k, num_stages=stages)
                fns = [functools.partial(launch_gemv, x, w, config, **kwargs) for w in weights]
                try:
                    sweep[f"{block_n}x{block_k}x{stages}"] = graph_time_us(fns, args.graph_replays)
                except Exception as error:  # a tile past the shared memory: recorded, not fatal
                    sweep[f"{block_n}x{block_k}x{stages}"] = f"{type(error).__name__}"
                    torch.cuda.synchronize()
            row["tile_sweep_us"] = sweep
            best = min((us, tile) for tile, us in sweep.items() if isinstance(us, float))
            print(f"fp8 {name:>12} m= 1 best tile {best[1]} {best[0]:.1f} us")
        row["floor_us"] = n * k / args.copy_tbps / 1e6
        print(
            f"fp8 {name:>12} m={m:>2} scaled_mm {row['scaled_mm_us']:6.1f} us | gemv "
            f"{row['gemv_us']:6.1f} us (floor {row['floor_us']:.1f} at {args.copy_tbps} TB/s)"
            + (f" | gated {row['gated_gemv_us']:.1f} us" if "gated_gemv_us" in row else "")
            + (
                f" | bf16 gemv {row['bf16_gemv_us']:.1f} gated {row['bf16_gated_gemv_us']:.1f} us"
                if "bf16_gemv_us" in row
                else ""
            )
            + f" | rel err {row['max_rel_err']:.1e}"
        )
        rows.append(row)
        del weights, scaled_mm, gemv
        torch.cuda.empty_cache()
    return rows


def sweep_configs(args, gemv_config_cls) -> list:
    """Every (block_n, block_k, num_warps, num_stages) combination asked for."""
    pairs = [tuple(int(v) for v in pair.split("x")) for pair in args.warps_stages]
    return [
        gemv_config_cls(block_n=n, block_k=k, num_warps=w, num_stages=s)
        for n, k, (w, s) in itertools.product(args.block_n, args.block_k, pairs)
    ]


def time_us(fn, rep_ms: int) -> float:
    from triton.testing import do_bench

    fn()  # warm-up: compiles a Triton config, picks the cuBLAS kernel
    torch.cuda.synchronize()
    return do_bench(fn, rep=rep_ms, return_mode="median") * 1e3


def max_relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.float() - expected.float()).abs().max() / expected.float().abs().max())


def bench_shape(name, n, k, m, configs, default, args) -> dict:
    """One row: F.linear, the default config and every swept config for x (m, k), W (n, k)."""
    from pieceworks.kernels.gemv.triton_gemv import launch_gemv

    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    expected = F.linear(x, weight)
    weight_bytes = weight.numel() * weight.element_size()
    tbps = lambda us: weight_bytes / (us * 1e-6) / 1e12
    linear_us = time_us(lambda: F.linear(x, weight), args.rep_ms)
    results = []
    configs = [dataclasses.replace(config, block_m=default.block_m) for config in configs]
    for config in [default, *[c for c in configs if c != default]]:
        try:
            error = max_relative_error(launch_gemv(x, weight, config), expected)
            us = time_us(lambda config=config: launch_gemv(x, weight, config), args.rep_ms)
        except Exception as exc:  # e.g. triton's OutOfResources for a config too big for the SM
            print(f"  {name} m={m} {config}: skipped ({type(exc).__name__})")
            continue
        results.append(dict(config=vars(config), time_us=us, tbps=tbps(us), max_rel_err=error))
    best = min(results, key=lambda result: result["time_us"])
    return dict(
        layer=name, n=n, k=k, m=m, weight_bytes=weight_bytes,
        linear=dict(time_us=linear_us, tbps=tbps(linear_us)),
        default=results[0], best=best, sweep=results,
        max_rel_err=max(result["max_rel_err"] for result in results),
    )  # fmt: skip


def print_row(row: dict) -> None:
    linear, default, best = row["linear"], row["default"], row["best"]
    config = "{block_n}x{block_k} w{num_warps} s{num_stages}".format(**best["config"])
    print(
        f"{row['layer']:>12} m={row['m']:>2} linear {linear['time_us']:6.1f} us "
        f"{linear['tbps']:4.2f} TB/s | default {default['time_us']:6.1f} us "
        f"{default['tbps']:4.2f} TB/s | best {best['time_us']:6.1f} us {best['tbps']:4.2f} TB/s "
        f"({config}) | max rel err {row['max_rel_err']:.1e}"
    )


def main() -> None:
    args = parse_args()
    if not torch.cuda.is_available():
        raise SystemExit(
            "gemv_decode.py times GPU kernels and needs a CUDA or ROCm GPU; none is visible "
            "(torch.cuda.is_available() is False). Run it on the GPU machine."
        )
    from pieceworks.kernels.gemv.triton_gemv import GemvConfig, gemv_config

    result = dict(device=torch.cuda.get_device_name(), torch=torch.__version__)
    if args.fp8:
        result["fp8"] = fp8_rows(args)
    else:
        result["graph"] = graph_rows(args)
    if args.sweep:
        configs = sweep_configs(args, GemvConfig)
        rows = []
        for (name, (n, k)), m in itertools.product(SHAPES.items(), args.num_tokens):
            rows.append(bench_shape(name, n, k, m, configs, gemv_config(m, n, k), args))
            print_row(rows[-1])
        worst = max(row["max_rel_err"] for row in rows)
        print(f"largest max relative error vs F.linear over all configs: {worst:.1e}")
        result["rows"] = rows
    with open(args.out, "w") as file:
        json.dump(result, file, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
