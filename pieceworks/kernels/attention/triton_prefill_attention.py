"""The prefill / mixed kernel of paged attention (``max_query_len > 1``): flash attention.

``_prefill_kernel`` runs over (query block, kv head); a tile row is one (query token, q head)
pair of the kv head's group, so decode rows in a mixed batch waste little of the tile. The query
blocks are numbered over the flattened batch: sequence ``s`` owns the blocks from
``query_start_loc[s] // BLOCK_Q + s`` up to the next sequence's first, at least
``cdiv(query_len, BLOCK_Q)`` of them, so ``T // BLOCK_Q + S`` programs per kv head cover any
batch of ``T`` tokens in ``S`` sequences: a graph captured for ``T`` tokens launches no more for
one long prompt than for many short ones (a grid over sequences times blocks of the longest
query would launch ``S * cdiv(T, BLOCK_Q)``, nearly all of them empty). Each program finds its
sequence in one load of ``query_start_loc``. Causal positions are ``seq_lens[s] - q_s + i``.
With ``HAS_WINDOW`` a query at position p sees keys ``p - sliding_window + 1 .. p``: the tile
loop starts at the block's first query's window start (no key before it is loaded) and the mask
drops the keys each row's window excludes. Planned and launched by ``triton_attention.py``; the
shared tile helpers are in ``triton_attention_tiles.py``.
"""

import triton
import triton.language as tl

from pieceworks.kernels.attention.triton_attention_tiles import (
    NEG_LARGE,
    _load_tile,
    _online_softmax_step,
    _paged_offsets,
)


@triton.jit
def _prefill_kernel(
    query_ptr, key_cache_ptr, value_cache_ptr, output_ptr,
    query_start_loc_ptr, seq_lens_ptr, block_tables_ptr,
    qk_scale,  # softmax scale * log2(e): scores live in base 2
    stride_q_t, stride_q_h, stride_o_t, stride_o_h,
    stride_cache_block, stride_cache_offset, stride_cache_h,
    stride_block_tables,
    sliding_window,  # read only with HAS_WINDOW
    num_seqs,
    NUM_QUERIES_PER_KV: tl.constexpr, HEAD_SIZE: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
):  # fmt: skip
    # One program: sequence `seq`, its query tokens [q_block * BLOCK_Q, +BLOCK_Q), all the q heads
    # of kv head `kv_head`. Tile row r is query token r // NUM_QUERIES_PER_KV of the block and
    # q head r % NUM_QUERIES_PER_KV of the group.
    flat_block, kv_head = tl.program_id(0), tl.program_id(1)
    seqs = tl.arange(0, BLOCK_S)
    starts = tl.load(query_start_loc_ptr + seqs, mask=seqs < num_seqs, other=0)
    first_blocks = tl.where(seqs < num_seqs, starts // BLOCK_Q + seqs, flat_block + 1)
    seq = tl.sum((first_blocks <= flat_block).to(tl.int32)) - 1  # first blocks rise strictly
    query_start = tl.load(query_start_loc_ptr + seq)
    q_block = flat_block - (query_start // BLOCK_Q + seq)
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
    kv_start = 0
    if HAS_WINDOW:  # the block's first query sees no key before its window
        kv_start = tl.maximum(context_len + q_block * BLOCK_Q - sliding_window + 1, 0)
    for tile_start in range(kv_start, kv_end, BLOCK_N):
        kv_pos = tile_start + tl.arange(0, BLOCK_N)  # (BLOCK_N,)
        kv_mask = kv_pos < kv_end
        kv_offsets = _paged_offsets(block_table, kv_pos, kv_mask, kv_head, stride_cache_block,
                                    stride_cache_offset, stride_cache_h, BLOCK_SIZE)  # fmt: skip
        k = _load_tile(key_cache_ptr, kv_offsets, dims, kv_mask)
        scores = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision="ieee") * qk_scale
        visible = (kv_pos[None, :] <= query_pos[:, None]) & kv_mask[None, :]
        if HAS_WINDOW:
            visible &= kv_pos[None, :] > query_pos[:, None] - sliding_window
        scores = tl.where(visible, scores, float("-inf"))  # (BLOCK_M, BLOCK_N)
        v = _load_tile(value_cache_ptr, kv_offsets, dims, kv_mask)
        m_i, l_i, acc = _online_softmax_step(scores, v.to(q.dtype), m_i, l_i, acc)

    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]  # a row that sees no key gets zeros
    out_offsets = tokens[:, None] * stride_o_t + heads[:, None] * stride_o_h + dims[None, :]
    tl.store(output_ptr + out_offsets, out.to(output_ptr.dtype.element_ty),
             mask=row_mask[:, None])  # fmt: skip
