"""The Triton building blocks both paged-attention kernels share (``triton_attention.py``).

A K/V tile of the paged cache: ``_paged_offsets`` maps (position, kv head) to offsets through the
block table, ``_load_tile`` loads it masked; ``_attend_tile`` scores a q tile against it and folds
it into the running (max, sum, accumulator) state with ``_online_softmax_step`` (flash attention's
online softmax, base 2). ``_output_scale`` and ``_store_output`` write a result in the query dtype
or, with an FP8 output scale, statically quantized to e4m3fn, rounding as
``kernels/triton_rounding.py`` does. ``NEG_LARGE`` is the finite stand-in for -inf as the running
max. Only ``@triton.jit`` functions: no launch happens here.
"""

import triton
import triton.language as tl

from pieceworks.core.norm_quant import KERNEL_FP8_MAX
from pieceworks.kernels.triton_rounding import round_to, round_to_e4m3

# Finite stand-in for -inf as the running max: exp2(-inf - NEG_LARGE) is 0, never NaN.
NEG_LARGE = tl.constexpr(-1.0e30)
_FP8_MAX = tl.constexpr(KERNEL_FP8_MAX)


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
