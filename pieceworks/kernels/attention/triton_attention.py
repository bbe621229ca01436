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
- prefill / mixed (`max_query_len > 1`): flash attention over (seq, query block, kv head); a tile
  row is one (query token, q head) pair of the kv head's group, so decode rows in a mixed batch
  waste little of the tile.

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
building the metadata (the runner), keeping launches per shape (the attention layer).
"""

import dataclasses

import torch
import triton
import triton.language as tl

from pieceworks.core.norm_quant import KERNEL_FP8_DTYPE, KERNEL_FP8_MAX, static_scaled_fp8_quant
from pieceworks.kernels.attention.workspace import DecodeWorkspace
from pieceworks.kernels.kernel_launch import KernelLaunch
from pieceworks.kernels.triton_launch import launch_options, pdl_start, programmatic_launch
from pieceworks.kernels.triton_rounding import TRITON_DTYPES, round_to, round_to_e4m3

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
# Finite stand-in for -inf as the running max: exp2(-inf - NEG_LARGE) is 0, never NaN.
NEG_LARGE = tl.constexpr(-1.0e30)
_FP8_MAX = tl.constexpr(KERNEL_FP8_MAX)


@triton.jit
def _decode_split_kv_kernel(
    query_ptr, key_cache_ptr, value_cache_ptr, output_ptr,
    partial_out_ptr, partial_lse_ptr,  # used only with several splits
    query_start_loc_ptr, seq_lens_ptr, block_tables_ptr,
    key_ptr, value_ptr, slot_mapping_ptr,  # the step's new K/V; read only with STORE_KV
    output_scale_ptr,  # read only with QUANT_OUT
    qk_scale,  # softmax scale * log2(e): scores live in base 2
    stride_q_t, stride_q_h, stride_o_t, stride_o_h,
    stride_cache_block, stride_cache_offset, stride_cache_h,
    stride_block_tables,
    stride_k_t, stride_k_h, stride_v_t, stride_v_h,
    NUM_QUERIES_PER_KV: tl.constexpr, HEAD_SIZE: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    NUM_KV_SPLITS: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr, STORE_KV: tl.constexpr,
    ROUND_DTYPE: tl.constexpr, QUANT_OUT: tl.constexpr, PDL: tl.constexpr,
    PEEL_FIRST_TILE: tl.constexpr,
):  # fmt: skip
    # One program: sequence `seq`, the q heads of kv head `kv_head`, context slice `split`.
    # Launched early (PDL), it is scheduled while q/k/v's producer may still run and reads, before
    # its wait, only what that kernel cannot write: the metadata (the runner writes it before the
    # step) and cache rows of earlier steps, so its first tile's K/V load during the wait.
    seq, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    # The three loads are independent: issued together, not one after another's branch.
    query_start = tl.load(query_start_loc_ptr + seq)
    query_end = tl.load(query_start_loc_ptr + seq + 1)
    seq_len = tl.load(seq_lens_ptr + seq)
    if query_end == query_start:  # padded sequence
        return
    if split >= _used_splits(seq_len, NUM_KV_SPLITS, BLOCK_N):
        # An empty split (the context is shorter than the splits cover) exits before its wait,
        # writing nothing: the reduce reads only the used splits, by the same rule. Launched
        # early, an empty split that waited would hold its place on the GPU through q/k/v's
        # producer (at batch 1 and 1088 tokens, 47 of 64 splits per kv head are empty).
        return
    tokens_per_split = _tokens_per_split(seq_len, NUM_KV_SPLITS, BLOCK_N)
    kv_start = split * tokens_per_split
    kv_end = tl.minimum(kv_start + tokens_per_split, seq_len)
    dims = tl.arange(0, HEAD_SIZE)
    last = seq_len - 1  # the position of this step's token
    # With STORE_KV this step's K/V come from the inputs, not the cache: the tiles stop before
    # the last position, and the split holding it folds the new token in from registers and
    # writes it to the cache at its end, for later steps; no program reads a row this launch
    # writes.
    cache_end = kv_end
    if STORE_KV:
        cache_end = tl.minimum(kv_end, last)
    block_table = block_tables_ptr + seq * stride_block_tables
    loop_start = kv_start
    if PEEL_FIRST_TILE:  # (planned with PDL) the first tile loads before the wait
        first_pos = kv_start + tl.arange(0, BLOCK_N)
        first_mask = first_pos < cache_end
        first_offsets = _paged_offsets(block_table, first_pos, first_mask, kv_head,
                                       stride_cache_block, stride_cache_offset, stride_cache_h,
                                       BLOCK_SIZE)  # fmt: skip
        k_first = _load_tile(key_cache_ptr, first_offsets, dims, first_mask)
        v_first = _load_tile(value_cache_ptr, first_offsets, dims, first_mask)
        loop_start += BLOCK_N
    output_scale = _output_scale(output_scale_ptr, QUANT_OUT)  # a parameter: before the wait
    if PDL:  # now let the reduce be scheduled, and wait for q/k/v's producer
        pdl_start()
    if STORE_KV:
        token = query_start.to(tl.int64)
        cache_dtype = key_cache_ptr.dtype.element_ty  # attend to what later steps will read
        k_new = tl.load(key_ptr + token * stride_k_t + kv_head * stride_k_h + dims)
        v_new = tl.load(value_ptr + token * stride_v_t + kv_head * stride_v_h + dims)
        k_new, v_new = k_new.to(cache_dtype), v_new.to(cache_dtype)

    rows = tl.arange(0, BLOCK_H)  # one tile row per q head of the group
    heads = kv_head * NUM_QUERIES_PER_KV + rows
    row_mask = rows < NUM_QUERIES_PER_KV
    q_offsets = query_start.to(tl.int64) * stride_q_t + heads[:, None] * stride_q_h + dims[None, :]
    q = tl.load(query_ptr + q_offsets, mask=row_mask[:, None], other=0.0)  # (BLOCK_H, D)

    m_i = tl.full([BLOCK_H], NEG_LARGE, tl.float32)  # running max (base-2 scores)
    l_i = tl.zeros([BLOCK_H], tl.float32)  # running sum of exp2(score - m_i)
    acc = tl.zeros([BLOCK_H, HEAD_SIZE], tl.float32)  # running sum of p @ V
    if PEEL_FIRST_TILE:
        m_i, l_i, acc = _attend_tile(q, k_first, v_first, first_mask, qk_scale, m_i, l_i, acc)
    for tile_start in range(loop_start, cache_end, BLOCK_N):
        kv_pos = tile_start + tl.arange(0, BLOCK_N)  # (BLOCK_N,)
        kv_mask = kv_pos < cache_end
        kv_offsets = _paged_offsets(block_table, kv_pos, kv_mask, kv_head, stride_cache_block,
                                    stride_cache_offset, stride_cache_h, BLOCK_SIZE)  # fmt: skip
        k = _load_tile(key_cache_ptr, kv_offsets, dims, kv_mask)
        v = _load_tile(value_cache_ptr, kv_offsets, dims, kv_mask)
        m_i, l_i, acc = _attend_tile(q, k, v, kv_mask, qk_scale, m_i, l_i, acc)

    if STORE_KV:
        if (kv_start <= last) & (last < kv_end):
            # One more column of scores, the new token's, folded in as a tile of width one.
            k_last = k_new.to(q.dtype).to(tl.float32)
            score = tl.sum(q.to(tl.float32) * k_last[None, :], axis=1) * qk_scale  # (BLOCK_H,)
            m_new = tl.maximum(m_i, score)
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(score - m_new)
            l_i = l_i * alpha + p
            acc = acc * alpha[:, None] + p[:, None] * v_new.to(q.dtype).to(tl.float32)[None, :]
            m_i = m_new
            slot = tl.load(slot_mapping_ptr + query_start)
            if slot >= 0:
                cache_offsets = ((slot // BLOCK_SIZE) * stride_cache_block
                                 + (slot % BLOCK_SIZE) * stride_cache_offset
                                 + kv_head * stride_cache_h + dims)  # fmt: skip
                tl.store(key_cache_ptr + cache_offsets, k_new)
                tl.store(value_cache_ptr + cache_offsets, v_new)

    # Partial result of this split, normalised; one without keys reports lse = -inf.
    partial_out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]  # (BLOCK_H, D)
    if NUM_KV_SPLITS == 1:  # the only split: its result is the output, no reduce follows
        out_offsets = (query_start.to(tl.int64) * stride_o_t + heads[:, None] * stride_o_h
                       + dims[None, :])  # fmt: skip
        _store_output(output_ptr + out_offsets, partial_out, output_scale, row_mask[:, None],
                      ROUND_DTYPE, QUANT_OUT)  # fmt: skip
    else:  # (a constexpr branch: not compiled for one split, whose scratch is a dummy)
        lse = tl.where(l_i > 0.0, m_i + tl.log2(tl.maximum(l_i, 1e-30)), float("-inf"))
        workspace_row = (seq * NUM_QUERIES_PER_KV * tl.num_programs(1) + heads) * NUM_KV_SPLITS
        workspace_row += split
        tl.store(partial_lse_ptr + workspace_row, lse, mask=row_mask)
        tl.store(partial_out_ptr + workspace_row[:, None] * HEAD_SIZE + dims[None, :],
                 partial_out, mask=row_mask[:, None])  # fmt: skip


@triton.jit
def _decode_reduce_kernel(
    partial_out_ptr, partial_lse_ptr, output_ptr, query_start_loc_ptr, seq_lens_ptr,
    output_scale_ptr,  # read only with QUANT_OUT
    stride_o_t, stride_o_h,
    HEAD_SIZE: tl.constexpr, NUM_KV_SPLITS: tl.constexpr, BLOCK_SPLITS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ROUND_DTYPE: tl.constexpr, QUANT_OUT: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    # One program: merge the splits of sequence `seq`, q head `head` into its output row.
    seq, head = tl.program_id(0), tl.program_id(1)
    # The runner writes the metadata before the step runs, the split kernel never: it is read
    # before the wait of a reduce launched early.
    query_start = tl.load(query_start_loc_ptr + seq)
    query_end = tl.load(query_start_loc_ptr + seq + 1)
    seq_len = tl.load(seq_lens_ptr + seq)
    splits = tl.arange(0, BLOCK_SPLITS)
    dims = tl.arange(0, HEAD_SIZE)
    workspace_row = (seq * tl.num_programs(1) + head) * NUM_KV_SPLITS + splits  # (BLOCK_SPLITS,)
    used = splits < _used_splits(seq_len, NUM_KV_SPLITS, BLOCK_N)
    output_scale = _output_scale(output_scale_ptr, QUANT_OUT)  # a parameter: before the wait too
    if PDL:  # launched early: wait for the split kernel
        pdl_start()
    # Every used split of a real sequence wrote its row (one without keys: lse -inf, zeros), so
    # both loads go out together; a padded sequence's rows are read and never used.
    lse = tl.load(partial_lse_ptr + workspace_row, mask=used, other=float("-inf"))
    partial_out = tl.load(partial_out_ptr + workspace_row[:, None] * HEAD_SIZE + dims[None, :],
                          mask=used[:, None], other=0.0)  # fmt: skip
    if query_end == query_start:  # padded sequence
        return
    is_used = lse > float("-inf")
    lse_max = tl.max(lse, axis=0)
    lse_max = tl.where(lse_max > float("-inf"), lse_max, 0.0)  # all splits empty: avoid -inf - -inf
    weights = tl.where(is_used, tl.exp2(lse - lse_max), 0.0)  # (BLOCK_SPLITS,)
    out = tl.sum(weights[:, None] * partial_out, axis=0)  # (D,)
    out = out / tl.maximum(tl.sum(weights, axis=0), 1e-30)  # no key at all: zeros, not NaN
    out_offsets = query_start.to(tl.int64) * stride_o_t + head * stride_o_h + dims
    _store_output(output_ptr + out_offsets, out, output_scale, True, ROUND_DTYPE, QUANT_OUT)


@triton.jit
def _tokens_per_split(seq_len, NUM_KV_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr):
    """The context slice of one split: whole tiles, as few as cover ``seq_len`` in
    ``NUM_KV_SPLITS`` slices (0 for an empty context)."""
    return tl.cdiv(tl.cdiv(seq_len, NUM_KV_SPLITS), BLOCK_N) * BLOCK_N


@triton.jit
def _used_splits(seq_len, NUM_KV_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr):
    """How many leading splits hold part of the context: the ones that write a partial result
    (split 0 always writes one, an empty context's included)."""
    tokens_per_split = tl.maximum(_tokens_per_split(seq_len, NUM_KV_SPLITS, BLOCK_N), 1)
    return tl.maximum(tl.cdiv(seq_len, tokens_per_split), 1)


@triton.jit
def _output_scale(output_scale_ptr, QUANT_OUT: tl.constexpr):
    """The FP8 output's static scale (1 without QUANT_OUT, unused)."""
    if QUANT_OUT:
        return tl.load(output_scale_ptr)
    return 1.0


@triton.jit
def _store_output(pointers, out, output_scale, mask, ROUND_DTYPE: tl.constexpr,
                  QUANT_OUT: tl.constexpr):  # fmt: skip
    """Store attention results; with QUANT_OUT as static_scaled_fp8_quant of the result in the
    model dtype, with the scale ``_output_scale`` read."""
    if QUANT_OUT:
        out = round_to_e4m3(round_to(out, ROUND_DTYPE) / output_scale, _FP8_MAX)
    tl.store(pointers, out.to(pointers.dtype.element_ty), mask=mask)


@triton.jit
def _prefill_kernel(
    query_ptr, key_cache_ptr, value_cache_ptr, output_ptr,
    query_start_loc_ptr, seq_lens_ptr, block_tables_ptr,
    qk_scale,  # softmax scale * log2(e): scores live in base 2
    stride_q_t, stride_q_h, stride_o_t, stride_o_h,
    stride_cache_block, stride_cache_offset, stride_cache_h,
    stride_block_tables,
    NUM_QUERIES_PER_KV: tl.constexpr, HEAD_SIZE: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    # One program: sequence `seq`, its query tokens [q_block * BLOCK_Q, +BLOCK_Q), all the q heads
    # of kv head `kv_head`. Tile row r is query token r // NUM_QUERIES_PER_KV of the block and
    # q head r % NUM_QUERIES_PER_KV of the group.
    seq, q_block, kv_head = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    query_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - query_start
    if q_block * BLOCK_Q >= query_len:  # past this sequence's queries (or a padded sequence)
        return
    context_len = tl.load(seq_lens_ptr + seq) - query_len  # tokens before the first query

    rows = tl.arange(0, BLOCK_M)
    query_idx = q_block * BLOCK_Q + rows // NUM_QUERIES_PER_KV  # (BLOCK_M,) within the sequence
    heads = kv_head * NUM_QUERIES_PER_KV + rows % NUM_QUERIES_PER_KV  # (BLOCK_M,)
    row_mask = (rows < BLOCK_Q * NUM_QUERIES_PER_KV) & (query_idx < query_len)
    tokens = (query_start + query_idx).to(tl.int64)  # (BLOCK_M,)
    dims = tl.arange(0, HEAD_SIZE)
    q_offsets = tokens[:, None] * stride_q_t + heads[:, None] * stride_q_h + dims[None, :]
    q = tl.load(query_ptr + q_offsets, mask=row_mask[:, None], other=0.0)  # (BLOCK_M, D)
    query_pos = context_len + query_idx  # (BLOCK_M,) absolute positions

    m_i = tl.full([BLOCK_M], NEG_LARGE, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_SIZE], tl.float32)
    # Causal: the last query of this block sees keys up to its own position, no further.
    kv_end = context_len + tl.minimum((q_block + 1) * BLOCK_Q, query_len)
    block_table = block_tables_ptr + seq * stride_block_tables
    for tile_start in range(0, kv_end, BLOCK_N):
        kv_pos = tile_start + tl.arange(0, BLOCK_N)  # (BLOCK_N,)
        kv_mask = kv_pos < kv_end
        kv_offsets = _paged_offsets(block_table, kv_pos, kv_mask, kv_head, stride_cache_block,
                                    stride_cache_offset, stride_cache_h, BLOCK_SIZE)  # fmt: skip
        k = _load_tile(key_cache_ptr, kv_offsets, dims, kv_mask)
        scores = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision="ieee") * qk_scale
        visible = (kv_pos[None, :] <= query_pos[:, None]) & kv_mask[None, :]
        scores = tl.where(visible, scores, float("-inf"))  # (BLOCK_M, BLOCK_N)
        v = _load_tile(value_cache_ptr, kv_offsets, dims, kv_mask)
        m_i, l_i, acc = _online_softmax_step(scores, v.to(q.dtype), m_i, l_i, acc)

    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]  # a row that sees no key gets zeros
    out_offsets = tokens[:, None] * stride_o_t + heads[:, None] * stride_o_h + dims[None, :]
    tl.store(output_ptr + out_offsets, out.to(output_ptr.dtype.element_ty),
             mask=row_mask[:, None])  # fmt: skip


@triton.jit
def _paged_offsets(block_table, kv_pos, kv_mask, kv_head, stride_cache_block,
                   stride_cache_offset, stride_cache_h, BLOCK_SIZE: tl.constexpr):  # fmt: skip
    """Element offset of (token kv_pos, kv_head, dim 0) in the cache, via the block table."""
    block_ids = tl.load(block_table + kv_pos // BLOCK_SIZE, mask=kv_mask, other=0).to(tl.int64)
    return (
        block_ids * stride_cache_block
        + (kv_pos % BLOCK_SIZE) * stride_cache_offset
        + kv_head * stride_cache_h
    )  # (BLOCK_N,)


@triton.jit
def _load_tile(cache_ptr, kv_offsets, dims, kv_mask):
    """Load a (BLOCK_N, D) K or V tile; masked rows read 0 so that 0 * garbage never makes NaN."""
    return tl.load(
        cache_ptr + kv_offsets[:, None] + dims[None, :], mask=kv_mask[:, None], other=0.0
    )


@triton.jit
def _attend_tile(q, k, v, kv_mask, qk_scale, m_i, l_i, acc):
    """Fold one K/V tile (BLOCK_N, D), masked rows excluded, into the running state of q."""
    scores = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision="ieee") * qk_scale
    scores = tl.where(kv_mask[None, :], scores, float("-inf"))  # (BLOCK_H, BLOCK_N)
    return _online_softmax_step(scores, v.to(q.dtype), m_i, l_i, acc)


@triton.jit
def _online_softmax_step(scores, v, m_i, l_i, acc):
    """Fold one tile of base-2 scores (M, N) and values (N, D) into the running (max, sum, acc)."""
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))  # (M,)
    alpha = tl.exp2(m_i - m_new)  # rescales what was accumulated under the old max
    p = tl.exp2(scores - m_new[:, None])  # (M, N); masked scores give exactly 0
    l_new = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    return m_new, l_new, acc


def choose_num_kv_splits(num_seqs: int, num_kv_heads: int, max_context_len: int) -> int:
    """Decode splits from shapes only: enough programs to fill the GPU, at most one per tile."""
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
) -> None:
    """Causal paged attention; `max_query_len` (host int, >= every query length) picks the path.

    Decode scratch comes from `workspace` when given, else is allocated for this call. With
    `output_scale` the FP8 `output` gets the result statically quantized (module docstring).
    """
    launch = plan_paged_attention(
        query, key_cache, value_cache, output, block_tables=block_tables, scale=scale,
        max_query_len=max_query_len, num_kv_splits=num_kv_splits, workspace=workspace,
        quantize_output=output_scale is not None,
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
) -> PagedAttentionLaunch | None:
    """Check the layouts and bind the launches for these shapes; None when there is no work.

    Everything here follows from shapes, strides and `max_query_len`, never from tensor values,
    so the launch serves any tensors of the same shapes and strides (graph replay included).
    With ``new_kv`` (the step's key and value, for their layout) a decode plan also stores them
    into the cache (``DecodeLaunch.stores_kv``); a prefill plan ignores it (store separately).
    With ``quantize_output`` the output is float8_e4m3fn and every call passes ``output_scale``:
    a decode plan quantizes in its reduce, a prefill plan is a ``QuantizedOutputLaunch``.
    """
    _check_attention_inputs(query, key_cache, value_cache, output, block_tables, quantize_output)
    if block_tables.shape[0] == 0 or query.shape[0] == 0:
        return None
    if max_query_len <= 1:
        return _plan_decode(query, key_cache, output, block_tables, scale, num_kv_splits,
                            workspace, new_kv, quantize_output)  # fmt: skip
    if not quantize_output:
        return _plan_prefill(query, key_cache, output, block_tables, scale, max_query_len)
    scratch = torch.empty(output.shape, dtype=query.dtype, device="meta")  # its layout only
    launch = _plan_prefill(query, key_cache, scratch, block_tables, scale, max_query_len)
    return QuantizedOutputLaunch(launch)


def _plan_decode(query, key_cache, output, block_tables, scale, num_kv_splits,
                 workspace, new_kv=None, quantize_output=False) -> DecodeLaunch:  # fmt: skip
    """Split-KV decode: partials per (seq, kv head, split), then one reduce per (seq, q head)."""
    num_seqs, max_blocks = block_tables.shape
    _, block_size, num_kv_heads, head_size = key_cache.shape
    num_heads = query.shape[1]
    if num_kv_splits is None:
        num_kv_splits = choose_num_kv_splits(num_seqs, num_kv_heads, max_blocks * block_size)
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
    split = KernelLaunch(
        _decode_split_kv_kernel,
        (num_seqs, num_kv_heads, num_kv_splits),
        (scale * LOG2_E, query.stride(0), query.stride(1), output.stride(0), output.stride(1),
         key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), block_tables.stride(0),
         key.stride(0), key.stride(1), value.stride(0), value.stride(1)),
        dict(NUM_QUERIES_PER_KV=num_queries_per_kv, HEAD_SIZE=head_size, BLOCK_SIZE=block_size,
             NUM_KV_SPLITS=num_kv_splits,
             BLOCK_H=max(16, triton.next_power_of_2(num_queries_per_kv)), BLOCK_N=DECODE_BLOCK_N,
             STORE_KV=new_kv is not None,
             num_warps=DECODE_NUM_WARPS, num_stages=DECODE_NUM_STAGES, PDL=pdl,
             # without PDL the plain loop (the peeled tile measured slower there)
             PEEL_FIRST_TILE=pdl,
             **launch_options(pdl), **output_options),
    )  # fmt: skip
    reduce = None if num_kv_splits == 1 else KernelLaunch(
        _decode_reduce_kernel,
        (num_seqs, num_heads),
        (output.stride(0), output.stride(1)),
        dict(HEAD_SIZE=head_size, NUM_KV_SPLITS=num_kv_splits,
             BLOCK_SPLITS=triton.next_power_of_2(num_kv_splits), BLOCK_N=DECODE_BLOCK_N,
             num_warps=4,
             PDL=pdl, **launch_options(pdl), **output_options),
    )  # fmt: skip
    return DecodeLaunch(split, reduce, partial_out, partial_lse,
                        stores_kv=new_kv is not None, quantizes_output=quantize_output)  # fmt: skip


def _plan_prefill(query, key_cache, output, block_tables, scale, max_query_len) -> KernelLaunch:
    """Flash attention over (seq, query block, kv head); decode rows of a mixed batch too."""
    num_seqs = block_tables.shape[0]
    _, block_size, num_kv_heads, head_size = key_cache.shape
    num_queries_per_kv = query.shape[1] // num_kv_heads
    block_m = _prefill_block_m(max_query_len * num_queries_per_kv, num_queries_per_kv)
    block_q = block_m // num_queries_per_kv
    return KernelLaunch(
        _prefill_kernel,
        (num_seqs, triton.cdiv(max_query_len, block_q), num_kv_heads),
        (scale * LOG2_E, query.stride(0), query.stride(1), output.stride(0), output.stride(1),
         key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), block_tables.stride(0)),
        dict(NUM_QUERIES_PER_KV=num_queries_per_kv, HEAD_SIZE=head_size, BLOCK_SIZE=block_size,
             BLOCK_M=block_m, BLOCK_Q=block_q, BLOCK_N=PREFILL_BLOCK_N,
             num_warps=8 if block_m >= 128 else 4, num_stages=PREFILL_NUM_STAGES),
    )  # fmt: skip


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
