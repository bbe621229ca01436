"""The jitted decode GEMV (``_gemv_kernel``) and its epilogue helpers.

``_gemv_kernel`` computes ``y = x W^T`` for at most 64 tokens: each program owns ``BLOCK_N``
output columns for all M rows (padded to 16 for the tensor cores), walks K in ``BLOCK_K`` chunks
and applies one epilogue after the K loop: gated (``act(gate) * up`` from the stacked
``_stacked_halves``; ``ACTIVATION`` is one of ``GATED_ACTIVATIONS``: ``silu``, ``gelu_tanh`` or
``gelu`` (erf), the GELUs by ``triton_gelu_and_mul.gelu``), rope (the pairs rotated with
``_rotary_factors`` and ``_rotate_pairs``) or static FP8 quantization. The algorithm, the operand
layout and its invariants are described in ``triton_gemv.py``, which launches the kernel
(``launch_gemv``) and registers its ops.
"""

from __future__ import annotations

import triton
import triton.language as tl

from pieceworks.core.norm_quant import KERNEL_FP8_MAX
from pieceworks.kernels.activation.triton_gelu_and_mul import gelu
from pieceworks.kernels.nvidia_pdl import gdc_launch_dependents, gdc_wait
from pieceworks.kernels.triton_rounding import round_to, round_to_e4m3

_FP8_MAX = tl.constexpr(KERNEL_FP8_MAX)
# the gated epilogue's activations: silu, gelu's tanh approximation, gelu's erf form
GATED_ACTIVATIONS = ("silu", "gelu_tanh", "gelu")


@triton.jit
def _gemv_kernel(
    x_ptr,
    weight_ptr,
    out_ptr,
    x_scale_ptr,
    weight_scale_ptr,
    out_scale_ptr,
    positions_ptr,
    cos_sin_ptr,
    num_tokens,
    out_features,
    in_features,
    stride_x,
    stride_weight,
    stride_out,
    stride_cos_sin,
    head_size,
    num_rotary_heads,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    SCALED: tl.constexpr,
    GATED: tl.constexpr,
    ACTIVATION: tl.constexpr,
    ROPE: tl.constexpr,
    ROUND_DTYPE: tl.constexpr,
    QUANT_OUT: tl.constexpr,
    PDL: tl.constexpr,
    RELEASE_AT_START: tl.constexpr,
):
    # GATED: the weight is [gate; up] (2 * out_features rows) and the program's tile stacks the
    # gate rows of its BLOCK_N columns on their up rows, so one tl.dot of 2 * BLOCK_N rows (a
    # full tensor-core tile) serves both; the accumulator is split in the epilogue.
    # ROPE: the same stacking for the pairs (i, i + D/2) of one head of a merged qkv weight;
    # "columns" count pairs, BLOCK_N of them per program, and BLOCK_N divides D/2.
    if RELEASE_AT_START:  # the next kernel may be scheduled now, on SMs this GEMV leaves idle;
        gdc_launch_dependents()  # it waits for this one (releases_at_start)
    BLOCK_ROWS: tl.constexpr = 2 * BLOCK_N if GATED or ROPE else BLOCK_N
    first_column = tl.program_id(0) * BLOCK_N
    rows = tl.arange(0, BLOCK_ROWS)
    row_columns = first_column + rows % BLOCK_N  # the output column (ROPE: pair) of each row
    if ROPE:  # pair c of head h = c // (D/2) is weight row h * D + c % (D/2), its partner D/2 on
        half = head_size // 2
        head = first_column // half
        weight_rows = row_columns + head * half + (rows // BLOCK_N) * half
    else:
        weight_rows = row_columns + (rows // BLOCK_N) * out_features  # up: out_features further
    row_mask = row_columns < out_features
    tokens = tl.arange(0, BLOCK_M)
    ks = tl.arange(0, BLOCK_K)
    token_mask = tokens < num_tokens
    weight_ptrs = weight_ptr + weight_rows.to(tl.int64)[:, None] * stride_weight  # (ROWS, 1)
    x_rows = x_ptr + tokens.to(tl.int64)[:, None] * stride_x  # (BLOCK_M, 1)
    acc = tl.zeros((BLOCK_ROWS, BLOCK_M), dtype=tl.float32)  # (N, M): y^T = W x^T
    # What the epilogue reads besides the product, no kernel of the step writes (parameters, the
    # rotary cache, the positions the runner copied before the step): read before the wait, so
    # that no load round trip follows the K loop
    if SCALED:
        scale = tl.load(x_scale_ptr) * tl.load(weight_scale_ptr)
    if QUANT_OUT:
        out_scale = tl.load(out_scale_ptr)
    if ROPE:
        pairs = first_column - head * half + tl.arange(0, BLOCK_N)  # within the head
        cos, sin = _rotary_factors(
            positions_ptr, cos_sin_ptr + pairs[:, None], stride_cos_sin, half, tokens, token_mask
        )
    if PDL:  # launched early, while the kernel before (x's producer) may still run
        gdc_wait()
    for k_start in range(0, in_features, BLOCK_K):
        k_mask = (k_start + ks) < in_features
        w = tl.load(
            weight_ptrs + (k_start + ks)[None, :],
            mask=row_mask[:, None] & k_mask[None, :],
            other=0.0,
        )  # (BLOCK_ROWS, BLOCK_K)
        x = tl.load(
            x_rows + (k_start + ks)[None, :],
            mask=token_mask[:, None] & k_mask[None, :],
            other=0.0,
        )  # (BLOCK_M, BLOCK_K)
        if UPCAST:
            w, x = w.to(tl.float32), x.to(tl.float32)
        acc = tl.dot(w, tl.trans(x), acc, input_precision=INPUT_PRECISION)
    if PDL and not RELEASE_AT_START:  # W is streamed: the next kernel may be scheduled now
        gdc_launch_dependents()  # (it waits for this one)
    if SCALED:  # FP8: y = (x_fp8 W_fp8^T) * x_scale * weight_scale
        acc = acc * scale
    if GATED:  # act(gate) * up, from gate and up as the unfused GEMM would have stored them
        gate, up = _stacked_halves(acc, BLOCK_N, BLOCK_M, ROUND_DTYPE)
        if ACTIVATION == "silu":
            acc = gate / (1.0 + tl.exp(-gate)) * up  # (BLOCK_N, BLOCK_M)
        else:  # "gelu_tanh" | "gelu": as the gelu_and_mul kernel computes it
            acc = gelu(gate, ACTIVATION == "gelu_tanh") * up
    if QUANT_OUT:  # static FP8 quantization, rounded as static_scaled_fp8_quant rounds
        acc = round_to_e4m3(acc / out_scale, _FP8_MAX)
    out_rows = out_ptr + tokens.to(tl.int64)[None, :] * stride_out  # (1, M)
    if ROPE:  # x1, x2 as the unfused GEMM stores them; q and k heads rotated, v heads as they are
        x1, x2 = _stacked_halves(acc, BLOCK_N, BLOCK_M, ROUND_DTYPE)
        if head < num_rotary_heads:
            x1, x2 = _rotate_pairs(x1, x2, cos, sin, ROUND_DTYPE)
        columns = head * head_size + pairs  # x2's: half further
        mask = token_mask[None, :]
        tl.store(out_rows + columns[:, None], x1.to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(out_rows + columns[:, None] + half, x2.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        columns = first_column + tl.arange(0, BLOCK_N)
        mask = (columns < out_features)[:, None] & token_mask[None, :]
        tl.store(out_rows + columns[:, None], acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _stacked_halves(acc, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, ROUND_DTYPE: tl.constexpr):
    """The two stacked row blocks of ``acc`` (2 * BLOCK_N, BLOCK_M), each (BLOCK_N, BLOCK_M) and
    rounded to ``ROUND_DTYPE`` as an unfused GEMM would have stored them."""
    first, second = tl.split(tl.permute(tl.reshape(acc, (2, BLOCK_N, BLOCK_M)), (1, 2, 0)))
    return round_to(first, ROUND_DTYPE), round_to(second, ROUND_DTYPE)


@triton.jit
def _rotary_factors(positions_ptr, cos_sin, stride_cos_sin, half, tokens, token_mask):
    """cos and sin (N, M) in float32 for the pairs at each token's position. ``cos_sin`` (N, 1):
    the pairs' cos columns of the cache row 0; sin is ``half`` further. Pad tokens read no
    position and get zeros (never stored)."""
    positions = tl.load(positions_ptr + tokens, mask=token_mask, other=0).to(tl.int64)
    cos_ptrs = cos_sin + positions[None, :] * stride_cos_sin  # (N, M)
    cos = tl.load(cos_ptrs, mask=token_mask[None, :], other=0.0).to(tl.float32)
    sin = tl.load(cos_ptrs + half, mask=token_mask[None, :], other=0.0).to(tl.float32)
    return cos, sin


@triton.jit
def _rotate_pairs(x1, x2, cos, sin, ROUND_DTYPE: tl.constexpr):
    """Neox rotary of the pairs ``x1, x2`` (N, M): ``x1 * cos - x2 * sin`` and ``x2 * cos + x1 *
    sin`` in float32, rounded once to ``ROUND_DTYPE`` (as Inductor computes the unfused
    rotation)."""
    rotated1 = round_to(x1 * cos - x2 * sin, ROUND_DTYPE)
    rotated2 = round_to(x2 * cos + x1 * sin, ROUND_DTYPE)
    return rotated1, rotated2
