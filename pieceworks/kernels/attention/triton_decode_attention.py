"""The decode kernels of paged attention (``max_query_len == 1``): split-KV ("flash-decoding").

``_decode_split_kv_kernel`` runs over (seq, kv_head, split): each program attends all the q heads
of one kv head (GQA packing, one tile row per q head) over one slice of the context and writes a
normalised partial output and its log-sum-exp to the workspace (with one split, the output
itself); planned with ``new_kv`` it also stores the step's K/V. ``_decode_reduce_kernel`` merges
the used splits per (seq, q head). Under programmatic dependent launch both wait inside
(``pdl_start``). The algorithm, the split rule and the launch are described in
``triton_attention.py``, which plans and launches these kernels; the shared tile helpers are in
``triton_attention_tiles.py``.
"""

import triton
import triton.language as tl

from pieceworks.kernels.attention.triton_attention_tiles import (
    NEG_LARGE,
    _attend_tile,
    _load_tile,
    _output_scale,
    _paged_offsets,
    _store_output,
)
from pieceworks.kernels.triton_launch import pdl_start


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
    sliding_window,  # read only with HAS_WINDOW: the query sees the last this many positions
    NUM_QUERIES_PER_KV: tl.constexpr, HEAD_SIZE: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    NUM_KV_SPLITS: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr, STORE_KV: tl.constexpr,
    ROUND_DTYPE: tl.constexpr, QUANT_OUT: tl.constexpr, PDL: tl.constexpr,
    PEEL_FIRST_TILE: tl.constexpr, HAS_WINDOW: tl.constexpr,
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
    # The splits cut the visible keys [window_start, seq_len): with a sliding window only its
    # last positions, so keys before the window are never loaded and the cost is bounded by it.
    visible_len = _visible_len(seq_len, sliding_window, HAS_WINDOW)
    if split >= _used_splits(visible_len, NUM_KV_SPLITS, BLOCK_N):
        # An empty split (the context is shorter than the splits cover) exits before its wait,
        # writing nothing: the reduce reads only the used splits, by the same rule. Launched
        # early, an empty split that waited would hold its place on the GPU through q/k/v's
        # producer (at batch 1 and 1088 tokens, 47 of 64 splits per kv head are empty).
        return
    tokens_per_split = _tokens_per_split(visible_len, NUM_KV_SPLITS, BLOCK_N)
    kv_start = split * tokens_per_split
    if HAS_WINDOW:
        kv_start += seq_len - visible_len  # the window's first position
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
    sliding_window,  # read only with HAS_WINDOW
    HEAD_SIZE: tl.constexpr, NUM_KV_SPLITS: tl.constexpr, BLOCK_SPLITS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ROUND_DTYPE: tl.constexpr, QUANT_OUT: tl.constexpr, PDL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
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
    visible_len = _visible_len(seq_len, sliding_window, HAS_WINDOW)
    used = splits < _used_splits(visible_len, NUM_KV_SPLITS, BLOCK_N)
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
def _visible_len(seq_len, sliding_window, HAS_WINDOW: tl.constexpr):
    """How many of the context's last positions a decode query sees: all ``seq_len`` of them,
    or with a sliding window at most ``sliding_window``."""
    if HAS_WINDOW:
        return tl.minimum(seq_len, sliding_window)
    return seq_len


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
