"""Host time of one decode attention layer call, piece by piece (what PIECEWISE pays per layer).

Times, per call and with one device sync after many calls: a bare Triton launch, the KV store,
the split-KV decode (both as one-off calls that check and plan every time), the layer's body with
its per-shape plan cached (``Attention.attend``: three launches), the whole
``unified_attention_with_output`` op through ``torch.ops`` with the forward context, and one
``CUDAGraph`` replay, at batch 1 with the 8B attention shape.

    python benchmarks/attention_host_overhead.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pieceworks.config import EngineConfig  # noqa: E402
from pieceworks.core.forward_context import set_forward_context  # noqa: E402
from pieceworks.models.attention.layer import Attention  # noqa: E402
from pieceworks.models.attention.metadata import AttentionMetadata  # noqa: E402
from pieceworks.models.attention.ops import paged_attention_triton, store_kv_cache_triton  # noqa: E402
from pieceworks.platforms import current_platform  # noqa: E402


@triton.jit
def _empty_kernel(a, b, c, d, e, f, g, h, n, BLOCK: tl.constexpr):
    pass


def per_call_us(fn, iters: int = 2000) -> float:
    for _ in range(50):
        fn()
    current_platform().synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    current_platform().synchronize()
    return (time.perf_counter() - start) / iters * 1e6


def main() -> None:
    device = current_platform().device()
    heads, kv_heads, dim, block, context = 32, 8, 128, 16, 1024
    num_blocks = context // block + 1
    q = torch.randn(1, heads, dim, device=device, dtype=torch.bfloat16)
    k = torch.randn(1, kv_heads, dim, device=device, dtype=torch.bfloat16)
    cache = torch.randn(2, num_blocks, block, kv_heads, dim, device=device, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    slots = torch.tensor([context - 1], device=device)
    metadata = AttentionMetadata(
        num_actual_tokens=1,
        max_query_len=1,
        query_start_loc=torch.tensor([0, 1], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([context], dtype=torch.int32, device=device),
        block_tables=torch.arange(num_blocks, dtype=torch.int32, device=device)[None],
        slot_mapping=slots,
    )
    config = EngineConfig()
    layer = Attention(heads, dim, dim**-0.5, kv_heads, config=config, prefix="bench.attn")
    layer.kv_cache = (cache[0], cache[1])
    x = torch.empty(8, device=device)
    rows = {
        "bare Triton launch (9 args)": lambda: _empty_kernel[(1,)](
            x, x, x, x, x, x, x, x, 8, BLOCK=16
        ),
        "store_kv_cache_triton": lambda: store_kv_cache_triton(k, k, cache[0], cache[1], slots),
        "paged_attention_triton (decode)": lambda: paged_attention_triton(
            q,
            cache[0],
            cache[1],
            out,
            query_start_loc=metadata.query_start_loc,
            seq_lens=metadata.seq_lens,
            block_tables=metadata.block_tables,
            scale=0.088,
            max_query_len=1,
        ),
    }
    flat_q, flat_k, flat_out = q.view(1, -1), k.view(1, -1), out.view(1, -1)
    rows["Attention.attend (cached plan)"] = lambda: layer.attend(
        flat_q, flat_k, flat_k, flat_out, metadata
    )
    with set_forward_context(metadata, config):
        rows["whole op via torch.ops"] = lambda: layer.op(
            flat_q, flat_k, flat_k, flat_out, "bench.attn"
        )
        for name, fn in rows.items():
            print(f"{name:<36} {per_call_us(fn):8.1f} us/call", flush=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        store_kv_cache_triton(k, k, cache[0], cache[1], slots)
    print(f"{'CUDAGraph.replay() (1 kernel)':<36} {per_call_us(graph.replay):8.1f} us/call")


if __name__ == "__main__":
    main()
