"""The residual add + RMSNorm + FP8 quant split across the two GEMVs around it.

Why: in an FP8 decode graph each decoder layer runs two "add the residual, RMSNorm, quantize"
kernels between its GEMVs (``o_proj`` -> norm -> ``gate_up_proj``, ``down_proj`` -> norm ->
the next layer's ``qkv_proj``): about 2.5 µs each on an H200 for a 4096-wide row, plus a launch
gap, for a few KB of work. Folding the whole norm into the GEMV after it (each program
normalising the row before its K loop) was measured and lost: every program paid the row's
latency before streaming its weights (``docs/performance.md``, session 7). Here the norm is cut
where its data are:

- the GEMV before it (the producer, ``ADD_RESIDUAL``) owns ``core.norm_quant.NORM_PARTIAL_WIDTH``
  (64) output columns per program; its epilogue adds the residual to its own columns (the
  GEMM's output rounded to the model dtype first, as ``add_rms_norm`` reads it), stores the new
  residual and the float32 sums, and the sum of the sums' squares over its columns: one float
  per token and program;
- the GEMV after it (the consumer, ``NORM_IN``) adds the producer's partial sums up to each
  token's ``1 / rms`` before its K loop (``num_partials`` floats) and normalises, multiplies by the
  norm weight and quantizes each K chunk of the float32 sums inside the loop, rounding as
  ``core.norm_quant`` does (bfloat16 after normalising and after the weight, then e4m3). Only
  the real tokens' rows are computed (``NORM_ROWS``, the token count's power of two); they are
  repeated to the tensor-core tile, whose extra rows are never stored.

The values equal the unfused ops' up to the order in which the squares are summed. The ops that
use this are in ``quantization/fp8_norm_split.py``; the pass that emits them in
``core/passes/norm_split.py``.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from pieceworks.models.layers.triton_rounding import round_to, round_to_e4m3


@dataclasses.dataclass(frozen=True)
class AddResidual:
    """The producer's epilogue operands: ``residual (T, N)`` in the model dtype, read; ``sums
    (T, N)`` float32 and ``partials (T, num_partials(N))`` float32, written."""

    residual: torch.Tensor
    sums: torch.Tensor
    partials: torch.Tensor


@dataclasses.dataclass(frozen=True)
class InputNorm:
    """The consumer's operands: the producer's ``partials``, the norm's ``weight (K,)`` and
    ``epsilon``; the GEMV's x is the producer's float32 sums."""

    partials: torch.Tensor
    weight: torch.Tensor
    epsilon: float


@triton.jit
def load_residual(
    residual_ptr, first_column, out_features, tokens, token_mask, stride, BLOCK_N: tl.constexpr
):
    """The residual under the program's columns, (BLOCK_N, BLOCK_M) float32."""
    columns = first_column + tl.arange(0, BLOCK_N)
    mask = (columns < out_features)[:, None] & token_mask[None, :]
    offsets = tokens.to(tl.int64)[None, :] * stride + columns[:, None]
    return tl.load(residual_ptr + offsets, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def add_residual(
    acc,
    residual,
    sums_ptr,
    partials_ptr,
    first_column,
    out_features,
    tokens,
    token_mask,
    stride,
    num_partials,
    ROUND_DTYPE: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """``acc`` (BLOCK_N, BLOCK_M), rounded to ``ROUND_DTYPE`` as the GEMM stores it, plus the
    residual: stores the float32 sums and the program's partial sum of their squares per token,
    and returns the sums rounded to ``ROUND_DTYPE`` (the new residual)."""
    columns = first_column + tl.arange(0, BLOCK_N)
    mask = (columns < out_features)[:, None] & token_mask[None, :]
    sums = round_to(acc, ROUND_DTYPE) + residual
    offsets = tokens.to(tl.int64)[None, :] * stride + columns[:, None]
    tl.store(sums_ptr + offsets, sums, mask=mask)
    squares = tl.where(mask, sums * sums, 0.0)
    partial_ptrs = partials_ptr + tokens * num_partials + tl.program_id(0)
    tl.store(partial_ptrs, tl.sum(squares, axis=0), mask=token_mask)
    return round_to(sums, ROUND_DTYPE)


@triton.jit
def inverse_rms(
    partials_ptr,
    num_partials,
    num_tokens,
    hidden_size,
    epsilon,
    NORM_ROWS: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    """Each token's ``1 / sqrt(mean(sum**2) + eps)`` from the producer's partials, (NORM_ROWS,)."""
    rows = tl.arange(0, NORM_ROWS)
    parts = tl.arange(0, BLOCK_P)
    mask = (rows < num_tokens)[:, None] & (parts < num_partials)[None, :]
    partials = tl.load(
        partials_ptr + rows[:, None] * num_partials + parts[None, :], mask=mask, other=0.0
    )
    return tl.rsqrt(tl.sum(partials, axis=1) / hidden_size + epsilon)


@triton.jit
def load_norm_chunk(
    sums_ptr, norm_weight_ptr, k_offsets, num_tokens, in_features, stride, NORM_ROWS: tl.constexpr
):
    """One K chunk of the float32 sums (NORM_ROWS, BLOCK_K) and of the norm weight (BLOCK_K,);
    zeros past ``in_features`` (the K loop loads one chunk ahead)."""
    rows = tl.arange(0, NORM_ROWS)
    k_mask = k_offsets < in_features
    mask = (rows < num_tokens)[:, None] & k_mask[None, :]
    offsets = rows.to(tl.int64)[:, None] * stride + k_offsets[None, :]
    sums = tl.load(sums_ptr + offsets, mask=mask, other=0.0)
    weight = tl.load(norm_weight_ptr + k_offsets, mask=k_mask, other=0.0).to(tl.float32)
    return sums, weight


@triton.jit
def normed_chunk(
    sums,
    weight,
    inv_rms,
    x_scale,
    NORM_ROWS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ROUND_DTYPE: tl.constexpr,
    EXACT_CASTS: tl.constexpr,
    fp8_max,
):
    """One K chunk of the normalised, quantized input, (BLOCK_M, BLOCK_K) float8_e4m3fn, from
    ``load_norm_chunk``'s: the ``NORM_ROWS`` real rows computed, repeated down the tile.
    ``EXACT_CASTS`` (the interpreter): round to e4m3 in float32 arithmetic first; a GPU's cast
    rounds to nearest even and saturates at +-448 itself."""
    normed = round_to(sums * inv_rms[:, None], ROUND_DTYPE)
    scaled = round_to(normed * weight[None, :], ROUND_DTYPE) / x_scale
    if EXACT_CASTS:
        scaled = round_to_e4m3(scaled, fp8_max)
    chunk = scaled.to(tl.float8e4nv)
    if NORM_ROWS < BLOCK_M:  # the tile's rows past the real ones repeat them (never stored)
        repeated = tl.broadcast_to(chunk[None, :, :], (BLOCK_M // NORM_ROWS, NORM_ROWS, BLOCK_K))
        chunk = tl.reshape(repeated, (BLOCK_M, BLOCK_K))
    return chunk
