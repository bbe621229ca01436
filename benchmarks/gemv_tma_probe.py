"""Probe: does loading W through TMA (a tensor descriptor) make the FP8 decode GEMV faster?

The question behind it (``docs/performance.md``, session 8): at one token the FP8 GEMVs of the 8B
shapes read their weights at 2.4 (o_proj) to 3.9 TB/s (gate_up), while cuBLAS's bf16 LM head, a
pure read of 1 GB, reaches about 4.45 TB/s on the same H200. This times, per 8B shape at m = 1,
each product in turn over ``--layers`` distinct weights inside one CUDA graph (as
``gemv_decode.py`` does): the production GEMV (``launch_gemv``, default config) against a plain
FP8 GEMV whose W tiles come through a host-side ``TensorDescriptor`` (TMA on Hopper) and whose x
rows are ordinary loads, over a small sweep of tile, stage and warp counts. Plain products only
(gate_up without its gated epilogue): the question is the read rate. Prints and writes µs, TB/s
and the max relative error against the production kernel.

Run (CUDA machine): python benchmarks/gemv_tma_probe.py --out gemv_tma.json
"""

import argparse
import functools
import itertools
import json

import torch
import triton
import triton.language as tl
from gemv_decode import SHAPES, graph_time_us  # benchmarks/ is on sys.path when run as a script
from triton.tools.tensor_descriptor import TensorDescriptor

from pieceworks.benchmarks.latency import measure_copy_bandwidth
from pieceworks.models.layers.triton_gemv import launch_gemv


@triton.jit
def _tma_gemv_kernel(
    x_ptr,
    w_desc,
    out_ptr,
    x_scale_ptr,
    w_scale_ptr,
    num_tokens,
    out_features,
    in_features,
    stride_x,
    stride_out,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    first = tl.program_id(0) * BLOCK_N
    tokens = tl.arange(0, BLOCK_M)
    ks = tl.arange(0, BLOCK_K)
    token_mask = tokens < num_tokens
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k in tl.range(0, in_features, BLOCK_K, num_stages=NUM_STAGES):
        w = w_desc.load([first, k])  # (BLOCK_N, BLOCK_K)
        x = tl.load(
            x_ptr + tokens[:, None] * stride_x + (k + ks)[None, :],
            mask=token_mask[:, None] & ((k + ks) < in_features)[None, :],
            other=0.0,
        )
        acc = tl.dot(w, tl.trans(x), acc)
    acc = acc * (tl.load(x_scale_ptr) * tl.load(w_scale_ptr))
    columns = first + tl.arange(0, BLOCK_N)
    mask = (columns < out_features)[:, None] & token_mask[None, :]
    out = out_ptr + tokens[None, :] * stride_out + columns[:, None]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)


def tma_gemv(x, weight, scale, block_n, block_k, stages, warps, descriptor) -> torch.Tensor:
    num_tokens, in_features = x.shape
    out = torch.empty(num_tokens, weight.shape[0], device=x.device, dtype=torch.bfloat16)
    grid = (triton.cdiv(weight.shape[0], block_n),)
    _tma_gemv_kernel[grid](
        x, descriptor, out, scale, scale, num_tokens, weight.shape[0], in_features, x.stride(0),
        out.stride(0), BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k, NUM_STAGES=stages,
        num_warps=warps,
    )  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--replays", type=int, default=20)
    args = parser.parse_args()
    fp8 = torch.float8_e4m3fn
    scale = torch.tensor(1.0, device="cuda")
    results: dict = {
        "device": torch.cuda.get_device_name(),
        "copy_tbps": measure_copy_bandwidth() / 1e12,
        "rows": [],
    }
    print(f"copy bandwidth {results['copy_tbps']:.2f} TB/s", flush=True)
    for name, (n, k) in SHAPES.items():
        x = torch.randn(1, k, device="cuda").to(fp8)
        weights = [
            (torch.randn(n, k, device="cuda") / k**0.5 * 64).to(fp8) for _ in range(args.layers)
        ]
        kwargs = dict(scales=(scale, scale), out_dtype=torch.bfloat16)
        row: dict = {"layer": name, "n": n, "k": k, "bytes": n * k}
        row["gemv_us"] = graph_time_us(
            [functools.partial(launch_gemv, x, w, **kwargs) for w in weights], args.replays
        )
        reference = launch_gemv(x, weights[0], **kwargs).float()
        sweep = {}
        for block_n, block_k, stages, warps in itertools.product(
            (64, 128), (128, 256), (4, 6, 8), (4, 8)
        ):
            tile = f"{block_n}x{block_k}x{stages}s{warps}w"
            try:
                descriptors = [TensorDescriptor.from_tensor(w, [block_n, block_k]) for w in weights]
                fns = [
                    functools.partial(tma_gemv, x, w, scale, block_n, block_k, stages, warps, d)
                    for w, d in zip(weights, descriptors)
                ]
                error = (fns[0]().float() - reference).abs().max() / reference.abs().max()
                sweep[tile] = {"us": graph_time_us(fns, args.replays), "rel_err": float(error)}
            except Exception as failure:  # a tile past the shared memory: recorded, not fatal
                sweep[tile] = {"error": f"{type(failure).__name__}: {str(failure)[:120]}"}
                torch.cuda.synchronize()
        row["tma_sweep"] = sweep
        timed = [(entry["us"], tile) for tile, entry in sweep.items() if "us" in entry]
        best_us, best_tile = min(timed) if timed else (float("nan"), "none")
        row["tma_best"] = {"tile": best_tile, "us": best_us}
        gemv_tbps, tma_tbps = (n * k / (us * 1e-6) / 1e12 for us in (row["gemv_us"], best_us))
        print(
            f"{name:>12}: gemv {row['gemv_us']:5.1f} us ({gemv_tbps:.2f} TB/s) | "
            f"tma best {best_tile} {best_us:5.1f} us ({tma_tbps:.2f} TB/s)",
            flush=True,
        )
        results["rows"].append(row)
        with open(args.out, "w") as f:  # partial results survive a kill
            json.dump(results, f, indent=1)
        del weights
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
