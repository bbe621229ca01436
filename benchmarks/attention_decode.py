"""Micro-benchmark: split-KV decode attention against the device's copy bandwidth.

Decode attention is memory-bound: it must read every cached K and V row of every sequence once.
This script first measures what a plain device-to-device copy achieves (bytes read + written per
second), then times `paged_attention_triton` decode steps (replayed from a captured CUDA graph,
median of `triton.testing.do_bench`, L2 flushed between runs) and reports the bytes the kernel
must move (K and V read + q read + output written), the achieved GB/s and its fraction of the
copy bandwidth. Each configuration is also checked once against `paged_attention_reference`.

With `--graph-layers N` each configuration instead runs N decode calls on N separate caches in one
graph (as a decode step runs one per layer, each cache read from HBM, not L2) and reports the
time per call over many replays, without flushing L2 between calls. `--launch early late` times
the kernels launched as by default where the device has PDL (early: the split kernel loads its
first K/V tile before it waits, and the reduce is scheduled at the split's wait) and planned as
without PDL (late: each kernel launched after the one before it ends). `--block-n` and
`--num-warps` sweep the split kernel's tile (keys per `tl.dot`, which also sets the smallest
split) and warps, e.g. for a head size the defaults were not tuned on.

Run (CUDA machine): PYTHONPATH=. python benchmarks/attention_decode.py --out decode.json
"""

import argparse
import itertools
import json

import torch
import triton
from gemv_decode import graph_time_us  # benchmarks/ is on sys.path when run as a script
from triton.testing import do_bench

from pieceworks.core.norm_quant import KERNEL_FP8_DTYPE
from pieceworks.kernels.attention import triton_attention
from pieceworks.models.attention.ops import (
    choose_num_kv_splits,
    paged_attention_reference,
    paged_attention_triton,
)

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
PROGRAMMATIC_LAUNCH = triton_attention.programmatic_launch


def no_pdl(device: torch.device) -> bool:
    return False


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="path of the JSON results file")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--context-lens", type=int, nargs="+", default=[1024, 8192])
    parser.add_argument("--num-heads", type=int, default=32)
    parser.add_argument("--num-kv-heads", type=int, default=8)
    parser.add_argument("--head-size", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="block-table width in tokens (default: the longest context)",
    )
    parser.add_argument(
        "--num-kv-splits",
        type=int,
        nargs="+",
        default=[0],
        help="splits to time; 0 means the built-in heuristic",
    )
    parser.add_argument(
        "--launch", nargs="+", choices=["early", "late"], default=["early"],
        help="plan the kernels with PDL where supported (early) or without it (late)",
    )  # fmt: skip
    parser.add_argument("--graph-layers", type=int, default=0, help="calls per graph (0: one)")
    parser.add_argument(
        "--block-n", type=int, nargs="+", default=[triton_attention.DECODE_BLOCK_N],
        help="keys per decode tile to time (the split size is a whole number of tiles)",
    )  # fmt: skip
    parser.add_argument(
        "--num-warps", type=int, nargs="+", default=[triton_attention.DECODE_NUM_WARPS],
        help="warps of the split kernel to time",
    )  # fmt: skip
    parser.add_argument("--fp8-output", action="store_true", help="FP8 output (for o_proj)")
    parser.add_argument("--copy-mib", type=int, default=2048, help="copy-bandwidth buffer size")
    parser.add_argument("--rep-ms", type=int, default=200, help="do_bench repetition time")
    parser.add_argument("--no-graph", action="store_true", help="time eager launches instead")
    parser.add_argument("--no-check", action="store_true", help="skip the reference check")
    return parser.parse_args()


def measure_copy_bandwidth(device: torch.device, num_mib: int, rep_ms: int) -> float:
    """GB/s of a large device-to-device copy, counting bytes read plus bytes written."""
    src = torch.randn(num_mib * 2**20 // 4, device=device)
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), rep=rep_ms, return_mode="median")
    return 2 * src.numel() * src.element_size() / (ms * 1e-3) / 1e9


def make_decode_batch(args, batch_size: int, context_len: int, device: torch.device) -> dict:
    """One decode step: every sequence has `context_len` cached tokens in shuffled blocks."""
    dtype = DTYPES[args.dtype]
    max_model_len = args.max_model_len or max(args.context_lens)
    if context_len > max_model_len:
        raise SystemExit(f"context {context_len} exceeds --max-model-len {max_model_len}")
    blocks_per_seq = triton.cdiv(context_len, args.block_size)
    num_blocks = batch_size * blocks_per_seq
    cache_shape = (num_blocks, args.block_size, args.num_kv_heads, args.head_size)
    block_tables = torch.zeros(
        batch_size, triton.cdiv(max_model_len, args.block_size), dtype=torch.int32, device=device
    )
    block_tables[:, :blocks_per_seq] = torch.randperm(num_blocks, device=device).view(
        batch_size, blocks_per_seq
    )
    query_shape = (batch_size, args.num_heads, args.head_size)
    output_dtype = KERNEL_FP8_DTYPE if args.fp8_output else dtype
    return dict(
        query=torch.randn(query_shape, dtype=dtype, device=device),
        output=torch.empty(query_shape, dtype=output_dtype, device=device),
        output_scale=torch.tensor(0.01, device=device) if args.fp8_output else None,
        key_cache=torch.randn(cache_shape, dtype=dtype, device=device),
        value_cache=torch.randn(cache_shape, dtype=dtype, device=device),
        query_start_loc=torch.arange(batch_size + 1, dtype=torch.int32, device=device),
        seq_lens=torch.full((batch_size,), context_len, dtype=torch.int32, device=device),
        block_tables=block_tables,
    )


def decode_step(batch: dict, scale: float, num_kv_splits: int | None):
    """A closure running one decode attention call on the batch's static buffers."""

    def step():
        paged_attention_triton(
            batch["query"],
            batch["key_cache"],
            batch["value_cache"],
            batch["output"],
            query_start_loc=batch["query_start_loc"],
            seq_lens=batch["seq_lens"],
            block_tables=batch["block_tables"],
            scale=scale,
            max_query_len=1,
            num_kv_splits=num_kv_splits,
            output_scale=batch["output_scale"],
        )

    return step


def capture(step) -> torch.cuda.CUDAGraph:
    """Warm up on a side stream (compiles the kernels), then capture one step."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    torch.cuda.synchronize()
    return graph


def check_against_reference(batch: dict, scale: float) -> float:
    """Max abs difference between the kernel's last output and the reference."""
    expected = torch.empty_like(batch["query"])
    paged_attention_reference(
        batch["query"],
        batch["key_cache"],
        batch["value_cache"],
        expected,
        query_start_loc=batch["query_start_loc"],
        seq_lens=batch["seq_lens"],
        block_tables=batch["block_tables"],
        scale=scale,
    )
    if batch["output_scale"] is not None:  # compare in the quantized domain's units
        expected = (expected / batch["output_scale"]).clamp(-448, 448).to(KERNEL_FP8_DTYPE)
    return (batch["output"].float() - expected.float()).abs().max().item()


def required_bytes(args, batch_size: int, context_len: int) -> int:
    """Bytes decode must move: K and V rows read, query read, output written."""
    element_size = DTYPES[args.dtype].itemsize
    kv = 2 * batch_size * context_len * args.num_kv_heads * args.head_size * element_size
    query_and_output = 2 * batch_size * args.num_heads * args.head_size * element_size
    return kv + query_and_output


def bench_config(
    args, batch_size, context_len, splits_arg, launch, tile, copy_gbps, device
) -> dict:
    """Time one (batch, context, splits, launch, (block_n, warps)) configuration; returns one
    result row."""
    # read when a call plans
    triton_attention.programmatic_launch = PROGRAMMATIC_LAUNCH if launch == "early" else no_pdl
    triton_attention.DECODE_BLOCK_N, triton_attention.DECODE_NUM_WARPS = tile
    batch = make_decode_batch(args, batch_size, context_len, device)
    scale = args.head_size**-0.5
    num_kv_splits = splits_arg or choose_num_kv_splits(
        batch_size, args.num_kv_heads, batch["block_tables"].shape[1] * args.block_size
    )
    step = decode_step(batch, scale, num_kv_splits)
    target = step
    if args.graph_layers:  # one call per layer, each on its own caches, many replays
        layers = [step] + [
            decode_step(
                make_decode_batch(args, batch_size, context_len, device), scale, num_kv_splits
            )  # fmt: skip
            for _ in range(args.graph_layers - 1)
        ]
        ms = graph_time_us(layers, replays=200) / 1e3
    else:
        if args.no_graph:
            step()
        else:
            target = capture(step).replay
        ms = do_bench(target, rep=args.rep_ms, return_mode="median")
    num_bytes = required_bytes(args, batch_size, context_len)
    gbps = num_bytes / (ms * 1e-3) / 1e9
    target()
    torch.cuda.synchronize()
    max_abs_err = None if args.no_check else check_against_reference(batch, scale)
    return dict(
        batch_size=batch_size,
        context_len=context_len,
        num_kv_splits=num_kv_splits,
        launch=launch,
        block_n=tile[0],
        num_warps=tile[1],
        time_us=ms * 1e3,
        bytes=num_bytes,
        gbps=gbps,
        fraction_of_copy=gbps / copy_gbps,
        max_abs_err=max_abs_err,
    )


def print_table(copy_gbps: float, rows: list[dict]) -> None:
    print(f"device-to-device copy: {copy_gbps:.0f} GB/s (read + write)")
    print(
        f"{'batch':>5} {'context':>7} {'splits':>6} {'launch':>6} {'tile':>5} {'warps':>5} "
        f"{'time_us':>9} {'MB':>8} "
        f"{'GB/s':>7} {'of copy':>7} {'max_err':>8}"
    )
    for row in rows:
        err = "-" if row["max_abs_err"] is None else f"{row['max_abs_err']:.1e}"
        print(
            f"{row['batch_size']:>5} {row['context_len']:>7} {row['num_kv_splits']:>6} "
            f"{row['launch']:>6} {row['block_n']:>5} {row['num_warps']:>5} "
            f"{row['time_us']:>9.1f} {row['bytes'] / 1e6:>8.2f} {row['gbps']:>7.0f} "
            f"{row['fraction_of_copy']:>7.1%} {err:>8}"
        )


def main() -> None:
    args = parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA or ROCm GPU")
    device = torch.device("cuda")
    torch.manual_seed(0)
    copy_gbps = measure_copy_bandwidth(device, args.copy_mib, args.rep_ms)
    rows = []
    for batch_size in args.batch_sizes:
        for context_len in args.context_lens:
            for splits_arg, launch, block_n, warps in itertools.product(
                args.num_kv_splits, args.launch, args.block_n, args.num_warps
            ):
                tile = (block_n, warps)
                rows.append(
                    bench_config(
                        args,
                        batch_size,
                        context_len,
                        splits_arg or None,
                        launch,
                        tile,
                        copy_gbps,
                        device,
                    )
                )
    print_table(copy_gbps, rows)
    with open(args.out, "w") as f:
        json.dump(
            dict(
                device=torch.cuda.get_device_name(device),
                config=vars(args),
                copy_gbps=copy_gbps,
                results=rows,
            ),
            f,
            indent=2,
        )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
