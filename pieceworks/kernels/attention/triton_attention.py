"""Paged attention in Triton: the GPU backend (CUDA and ROCm; also runs under TRITON_INTERPRET=1).

Owns `paged_attention_triton`, which computes exactly what `reference.py` defines (ragged
sequences, causal positions `seq_lens[s] - q_s + i`, GQA, padded sequences skipped) with two paths:

- decode (`max_query_len == 1`): split-KV ("flash-decoding"). The grid is (seq, kv_head, split);
  each program attends all the q heads of one kv head (GQA packing, one tile row per q head) over
  one slice of the context, and writes a normalised partial output and its log-sum-exp to a
  workspace; `_decode_reduce_kernel` then merges the splits per (seq, q head). Where the device has
  programmatic dependent launch both are launched early: the split kernel loads its metadata and
  first K/V tile while the kernel that writes q/k/v (the rotary qkv GEMV releases it at its start)
  still runs, then waits; the reduce waits for the split kernel inside. Both read the FP8 output
  scale before their wait. With one split (large batches) the split kernel writes the output itself
  and no reduce runs. The number of splits comes
  from shapes only; each sequence cuts its own length into that many slices (rounded up to whole
  tiles), so short sequences leave trailing splits empty: those exit at once, and the reduce reads
  only the used ones.
  Planned with `new_kv`, the split kernel also stores the step's K/V (the split holding the last
  position uses them from registers and writes them at its end), saving the separate store
  launch; the attention backend does this for every decode step.
- prefill / mixed (`max_query_len > 1`): flash attention over (query block, kv head), the query
  blocks numbered over the flattened batch (`T // BLOCK_Q + S` of them for `T` tokens in `S`
  sequences, whatever the longest query); a tile row is one (query token, q head) pair of the kv
  head's group, so decode rows in a mixed batch waste little of the tile.

Sliding window (`sliding_window` W, Mistral's): a query at position p sees keys `p - W + 1 .. p`.
The decode splits cut only the last `min(seq_len, W)` positions (the split count, too, looks at
no more than W), and the prefill tile loop starts at its query block's first window start, so
no K/V row before a window is loaded (block-table entries there may be freed: never read) and
a decode step costs at most W keys. It is a run-time argument behind the constexpr
`HAS_WINDOW`: full attention compiles the kernels without it.

FP8 output (`output_scale`, for an FP8 `o_proj`): the result is written as
`static_scaled_fp8_quant(result in the query dtype, output_scale)`. The decode kernel that writes
the output (the reduce, or the only split) does it in its epilogue (no kernel of its own); the
prefill / mixed path attends into a scratch tensor of the query dtype and quantizes that with
torch (`QuantizedOutputLaunch`): correct, not fused.

Both read all metadata from device tensors: no `.item()`, no host sync, grids and workspace sized
from shapes and the host int `max_query_len`, so a decode step can be captured into a graph and
replayed with new values in the same buffers. Because of that, `plan_paged_attention` can do all
the host-side work (checks, split count, grids, strides, workspace) once per shape and return a
launch that later calls reuse with only their tensors. Not owned here: writing the cache for
prefill and mixed steps (`kv_cache.py`), choosing this backend over the reference (the platform),
building the metadata (the runner), keeping launches per shape (the attention layer). The jitted
kernels themselves are in ``triton_decode_attention.py`` and ``triton_prefill_attention.py``
(shared tiles: ``triton_attention_tiles.py``); this module plans and launches them.
"""

import dataclasses

import torch
import triton

from pieceworks.core.norm_quant import KERNEL_FP8_DTYPE, static_scaled_fp8_quant
from pieceworks.kernels.attention.triton_decode_attention import (
    _decode_reduce_kernel,
    _decode_split_kv_kernel,
)
from pieceworks.kernels.attention.triton_prefill_attention import _prefill_kernel
from pieceworks.kernels.attention.workspace import DecodeWorkspace
from pieceworks.kernels.kernel_launch import KernelLaunch
from pieceworks.kernels.triton_launch import launch_options, programmatic_launch
from pieceworks.kernels.triton_rounding import TRITON_DTYPES

# Decode split heuristic: aim for this many programs in flight (a few per SM on a large GPU) ...
TARGET_DECODE_PROGRAMS = 512
# ... but never more splits than this (the reduce reads them all) ...
MAX_KV_SPLITS = 64
# ... and tokens per decode tile (one tl.dot), which also bounds the split size from below.
DECODE_BLOCK_N = 64
# Pipelining. An H200 sweep (bf16, 32/8 heads, dim 128) put decode within ~2% over warps 2-8 and
# stages 2-4 at BLOCK_N 64, and prefill ~10% below its best (BLOCK_N 128, 3 stages); these
# smaller settings also fit the shared memory of smaller GPUs.
DECODE_NUM_WARPS, DECODE_NUM_STAGES = 4, 2
PREFILL_BLOCK_N = 64
PREFILL_NUM_STAGES = 2
LOG2_E = 1.4426950408889634


def choose_num_kv_splits(num_seqs: int, num_kv_heads: int, max_context_len: int) -> int:
    """Decode splits from shapes only: enough programs to fill the GPU, at most one per tile
    of ``max_context_len`` (the most keys one query sees: at most the sliding window)."""
    wanted = triton.cdiv(TARGET_DECODE_PROGRAMS, max(num_seqs * num_kv_heads, 1))
    useful = triton.cdiv(max(max_context_len, 1), DECODE_BLOCK_N)
    return max(1, min(wanted, useful, MAX_KV_SPLITS))


def paged_attention_triton(
    query: torch.Tensor,  # (T, Hq, D)
    key_cache: torch.Tensor,  # (num_blocks, block_size, Hkv, D)
    value_cache: torch.Tensor,  # (num_blocks, block_size, Hkv, D)
    output: torch.Tensor,  # (T, Hq, D), written in place
    *,
    query_start_loc: torch.Tensor,  # (S + 1,) int32
    seq_lens: torch.Tensor,  # (S,) int32, context length including the new query tokens
    block_tables: torch.Tensor,  # (S, max_blocks) int32
    scale: float,
    max_query_len: int,
    num_kv_splits: int | None = None,
    workspace: DecodeWorkspace | None = None,
    output_scale: torch.Tensor | None = None,  # 0-d float32: output is float8_e4m3fn
    sliding_window: int | None = None,  # None: the whole context
) -> None:
    """Causal paged attention; `max_query_len` (host int, >= every query length) picks the path.

    Decode scratch comes from `workspace` when given, else is allocated for this call. With
    `output_scale` the FP8 `output` gets the result statically quantized (module docstring).
    """
    launch = plan_paged_attention(
        query, key_cache, value_cache, output, block_tables=block_tables, scale=scale,
        max_query_len=max_query_len, num_kv_splits=num_kv_splits, workspace=workspace,
        quantize_output=output_scale is not None, sliding_window=sliding_window,
    )  # fmt: skip
    if launch is None:
        return
    quantized = {} if output_scale is None else {"output_scale": output_scale}
    launch(query, key_cache, value_cache, output, query_start_loc, seq_lens, block_tables,
           **quantized)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class DecodeLaunch:
    """Split-KV decode bound for one shape: partials, then the reduce kernel that merges them;
    with one split, the split kernel alone (it writes the output, ``reduce`` is None).

    With ``stores_kv`` the split kernel also writes the step's new K/V into the cache (one launch
    fewer than a separate store); the call then takes ``new_kv=(key, value, slot_mapping)``.
    With ``quantizes_output`` the output is FP8 (quantized where it is written); the call then
    takes ``output_scale``, a tensor read at run time, so one plan serves any scale at a fixed
    address.
    """

    split: KernelLaunch
    reduce: KernelLaunch | None
    partial_out: torch.Tensor  # (S, Hq, splits, D) float32
    partial_lse: torch.Tensor  # (S, Hq, splits) float32
    stores_kv: bool = False
    quantizes_output: bool = False

    def __call__(self, query, key_cache, value_cache, output, query_start_loc, seq_lens,
                 block_tables, new_kv=None, output_scale=None) -> None:  # fmt: skip
        if self.stores_kv != (new_kv is not None):
            raise ValueError("pass new_kv=(key, value, slot_mapping) exactly when planned to store")
        if self.quantizes_output != (output_scale is not None):
            raise ValueError("pass output_scale exactly when planned to quantize the output")
        key, value, slot_mapping = new_kv or (query, query, seq_lens)  # unread without a store
        scale = output if output_scale is None else output_scale  # unread without quantizing
        self.split(query, key_cache, value_cache, output, self.partial_out, self.partial_lse,
                   query_start_loc, seq_lens, block_tables, key, value, slot_mapping,
                   scale)  # fmt: skip
        if self.reduce is not None:
            self.reduce(self.partial_out, self.partial_lse, output, query_start_loc, seq_lens,
                        scale)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class QuantizedOutputLaunch:
    """A prefill launch planned on a contiguous scratch tensor of the query dtype; each call
    attends into a new one, then writes ``static_scaled_fp8_quant(scratch, output_scale)`` into
    the FP8 ``output`` (every row: rows no sequence owns hold whatever the scratch held)."""

    launch: KernelLaunch

    def __call__(self, query, key_cache, value_cache, output, query_start_loc, seq_lens,
                 block_tables, output_scale) -> None:  # fmt: skip
        result = torch.empty(output.shape, dtype=query.dtype, device=output.device)
        self.launch(query, key_cache, value_cache, result, query_start_loc, seq_lens, block_tables)
        output.copy_(static_scaled_fp8_quant(result, output_scale, output.dtype))


# Every launch is called as launch(query, key_cache, value_cache, output, query_start_loc,
# seq_lens, block_tables): the prefill kernel takes exactly these tensors, in this order. A plan
# that quantizes its output also takes output_scale=.
PagedAttentionLaunch = DecodeLaunch | KernelLaunch | QuantizedOutputLaunch


def plan_paged_attention(
    query: torch.Tensor,  # (T, Hq, D)
    key_cache: torch.Tensor,  # (num_blocks, block_size, Hkv, D)
    value_cache: torch.Tensor,  # (num_blocks, block_size, Hkv, D)
    output: torch.Tensor,  # (T, Hq, D)
    *,
    block_tables: torch.Tensor,  # (S, max_blocks) int32
    scale: float,
    max_query_len: int,
    num_kv_splits: int | None = None,
    workspace: DecodeWorkspace | None = None,
    new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,  # (T, Hkv, D) each
    quantize_output: bool = False,
    sliding_window: int | None = None,  # None: the whole context
) -> PagedAttentionLaunch | None:
    """Check the layouts and bind the launches for these shapes; None when there is no work.

    Everything here follows from shapes, strides and `max_query_len`, never from tensor values,
    so the launch serves any tensors of the same shapes and strides (graph replay included).
    With ``new_kv`` (the step's key and value, for their layout) a decode plan also stores them
    into the cache (``DecodeLaunch.stores_kv``); a prefill plan ignores it (store separately).
    With ``quantize_output`` the output is float8_e4m3fn and every call passes ``output_scale``:
    a decode plan quantizes in its reduce, a prefill plan is a ``QuantizedOutputLaunch``.
    With ``sliding_window`` each query sees only that many last positions (module docstring).
    """
    _check_attention_inputs(query, key_cache, value_cache, output, block_tables, quantize_output)
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window {sliding_window} must be at least 1 (or None)")
    if block_tables.shape[0] == 0 or query.shape[0] == 0:
        return None
    if max_query_len <= 1:
        return _plan_decode(query, key_cache, output, block_tables, scale, num_kv_splits,
                            workspace, new_kv, quantize_output, sliding_window)  # fmt: skip
    if quantize_output:
        output = torch.empty(output.shape, dtype=query.dtype, device="meta")  # scratch layout
    launch = _plan_prefill(query, key_cache, output, block_tables, scale, max_query_len,
                           sliding_window)  # fmt: skip
    return QuantizedOutputLaunch(launch) if quantize_output else launch


def _plan_decode(query, key_cache, output, block_tables, scale, num_kv_splits, workspace,
                 new_kv=None, quantize_output=False,
                 sliding_window=None) -> DecodeLaunch:  # fmt: skip
    """Split-KV decode: partials per (seq, kv head, split), then one reduce per (seq, q head)."""
    num_seqs, max_blocks = block_tables.shape
    _, block_size, num_kv_heads, head_size = key_cache.shape
    num_heads = query.shape[1]
    if num_kv_splits is None:
        max_visible = max_blocks * block_size
        if sliding_window is not None:
            max_visible = min(max_visible, sliding_window)
        num_kv_splits = choose_num_kv_splits(num_seqs, num_kv_heads, max_visible)
    if num_kv_splits < 1:
        raise ValueError(f"num_kv_splits must be >= 1, got {num_kv_splits}")
    if num_kv_splits == 1:  # no partials: the split kernel writes the output itself
        partial_out = partial_lse = output  # unread
    else:
        workspace = workspace or DecodeWorkspace()
        partial_out, partial_lse = workspace.get(
            num_seqs, num_heads, num_kv_splits, head_size, query.device
        )
    num_queries_per_kv = num_heads // num_kv_heads
    if new_kv is not None:
        _check_new_kv(new_kv, query, key_cache)
    key, value = new_kv or (query, query)  # strides unused without a store
    # Under PDL the rotary qkv GEMV releases the split kernel at its own start, the split kernel
    # loads its metadata and first K/V tile before it waits for q, and the reduce is scheduled at
    # the split's wait, so the three overlap instead of running one after the other.
    pdl = programmatic_launch(query.device)
    output_options = dict(ROUND_DTYPE=TRITON_DTYPES[query.dtype], QUANT_OUT=quantize_output)
    window = _window_arguments(sliding_window)
    split = KernelLaunch(
        _decode_split_kv_kernel,
        (num_seqs, num_kv_heads, num_kv_splits),
        (scale * LOG2_E, query.stride(0), query.stride(1), output.stride(0), output.stride(1),
         key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), block_tables.stride(0),
         key.stride(0), key.stride(1), value.stride(0), value.stride(1), window["window"]),
        dict(NUM_QUERIES_PER_KV=num_queries_per_kv, HEAD_SIZE=head_size, BLOCK_SIZE=block_size,
             NUM_KV_SPLITS=num_kv_splits,
             BLOCK_H=max(16, triton.next_power_of_2(num_queries_per_kv)), BLOCK_N=DECODE_BLOCK_N,
             STORE_KV=new_kv is not None,
             num_warps=DECODE_NUM_WARPS, num_stages=DECODE_NUM_STAGES, PDL=pdl,
             # without PDL the plain loop (the peeled tile measured slower there)
             PEEL_FIRST_TILE=pdl, HAS_WINDOW=window["HAS_WINDOW"],
             **launch_options(pdl), **output_options),
    )  # fmt: skip
    reduce = None if num_kv_splits == 1 else KernelLaunch(
        _decode_reduce_kernel,
        (num_seqs, num_heads),
        (output.stride(0), output.stride(1), window["window"]),
        dict(HEAD_SIZE=head_size, NUM_KV_SPLITS=num_kv_splits,
             BLOCK_SPLITS=triton.next_power_of_2(num_kv_splits), BLOCK_N=DECODE_BLOCK_N,
             num_warps=4, HAS_WINDOW=window["HAS_WINDOW"],
             PDL=pdl, **launch_options(pdl), **output_options),
    )  # fmt: skip
    return DecodeLaunch(split, reduce, partial_out, partial_lse,
                        stores_kv=new_kv is not None, quantizes_output=quantize_output)  # fmt: skip


def _plan_prefill(query, key_cache, output, block_tables, scale, max_query_len,
                  sliding_window=None) -> KernelLaunch:  # fmt: skip
    """Flash attention over (query block, kv head); decode rows of a mixed batch too."""
    num_seqs = block_tables.shape[0]
    _, block_size, num_kv_heads, head_size = key_cache.shape
    num_queries_per_kv = query.shape[1] // num_kv_heads
    block_m = _prefill_block_m(max_query_len * num_queries_per_kv, num_queries_per_kv)
    block_q = block_m // num_queries_per_kv
    window = _window_arguments(sliding_window)
    # query blocks over the flattened batch (the kernel's docstring): at most T // BLOCK_Q + S
    num_blocks = query.shape[0] // block_q + num_seqs
    return KernelLaunch(
        _prefill_kernel,
        (num_blocks, num_kv_heads),
        (scale * LOG2_E, query.stride(0), query.stride(1), output.stride(0), output.stride(1),
         key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), block_tables.stride(0),
         window["window"], num_seqs),
        dict(NUM_QUERIES_PER_KV=num_queries_per_kv, HEAD_SIZE=head_size, BLOCK_SIZE=block_size,
             BLOCK_M=block_m, BLOCK_Q=block_q, BLOCK_N=PREFILL_BLOCK_N,
             BLOCK_S=triton.next_power_of_2(num_seqs),
             HAS_WINDOW=window["HAS_WINDOW"],
             num_warps=8 if block_m >= 128 else 4, num_stages=PREFILL_NUM_STAGES),
    )  # fmt: skip


def _window_arguments(sliding_window: int | None) -> dict:
    """The kernels' window argument (unread without one: 0) and their HAS_WINDOW constexpr."""
    return {"window": sliding_window or 0, "HAS_WINDOW": sliding_window is not None}


def _prefill_block_m(max_rows: int, num_queries_per_kv: int) -> int:
    """Tile rows (query tokens x group heads): big tiles for long queries, >= 16 for tl.dot."""
    block_m = 128 if max_rows >= 128 else 64 if max_rows >= 64 else 16
    return max(block_m, triton.next_power_of_2(num_queries_per_kv))


def _check_new_kv(new_kv, query, key_cache) -> None:
    """The step's key and value as the fused decode store reads them: (T, Hkv, D), unit D stride."""
    expected = (query.shape[0], key_cache.shape[2], key_cache.shape[3])
    for name, tensor in zip(("key", "value"), new_kv, strict=True):
        if tuple(tensor.shape) != expected or tensor.stride(-1) != 1:
            raise ValueError(
                f"{name} {tuple(tensor.shape)} (strides {tensor.stride()}) must be {expected} and "
                "contiguous along the head dimension"
            )


def _check_attention_inputs(query, key_cache, value_cache, output, block_tables,
                            quantize_output=False) -> None:  # fmt: skip
    """Reject layouts the kernels cannot address (they assume unit stride along D)."""
    if (output.dtype == KERNEL_FP8_DTYPE) != quantize_output or query.dtype not in TRITON_DTYPES:
        raise ValueError(
            f"output dtype {output.dtype} with query dtype {query.dtype}: the output must be "
            "float8_e4m3fn exactly when it is quantized (output_scale given), and the query one "
            f"of {list(TRITON_DTYPES)}"
        )
    num_heads, head_size = query.shape[1:]
    num_kv_heads = key_cache.shape[2]
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"{num_heads} query heads is not a multiple of {num_kv_heads} kv heads")
    if head_size < 16 or head_size & (head_size - 1) or key_cache.shape[3] != head_size:
        raise ValueError(
            f"head size {head_size} (cache {key_cache.shape[3]}) must be a power of two >= 16"
        )
    if key_cache.shape != value_cache.shape or key_cache.stride() != value_cache.stride():
        raise ValueError("key_cache and value_cache must share one shape and memory layout")
    if output.shape != query.shape:
        raise ValueError(f"output {tuple(output.shape)} must match query {tuple(query.shape)}")
    for name, tensor in (("query", query), ("output", output), ("key_cache", key_cache)):
        if tensor.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous along the head dimension")
    if block_tables.stride(1) != 1:
        raise ValueError("block_tables rows must be contiguous")
