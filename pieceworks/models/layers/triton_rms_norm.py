"""RMSNorm (+ residual add) + static FP8 quantization of one token row, as a Triton helper.

``rms_norm_quant_row`` is the body both users share: the fused op's kernel runs it once per
program (``quantization/triton_norm_quant.py``), and the FP8 GEMV runs it as a prologue when it
takes the norm's input instead of FP8 activations (``triton_gemv.py``, ``NORM``). It loads the
row once, optionally adds the residual (and stores the sum), reduces the mean square in float32,
normalises, rounds to the activation dtype and multiplies by the weight exactly as
``core.norm_quant.rms_norm`` does, divides by the static scale, saturates to +-448 and stores
``float8_e4m3fn``. Every rounding is done in float32 arithmetic before the cast
(``triton_rounding.py``), so the bytes equal torch's under the interpreter as on a GPU.
"""

from __future__ import annotations

import triton
import triton.language as tl

from pieceworks.models.layers.triton_rounding import round_to, round_to_e4m3


@triton.jit
def rms_norm_quant_row(
    input_ptr,
    residual_ptr,
    weight_ptr,
    scale_ptr,
    result_ptr,
    residual_out_ptr,
    row,
    hidden_size,
    epsilon,
    fp8_max,
    BLOCK_SIZE: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    store_residual,
):
    """``result[row] <- quant(rms_norm(input[row] (+ residual[row])))``, rows contiguous and
    ``hidden_size <= BLOCK_SIZE`` wide; the sum is stored to ``residual_out[row]`` where
    ``HAS_RESIDUAL`` and ``store_residual`` (a runtime flag: one of many programs stores it)."""
    cols = tl.arange(0, BLOCK_SIZE)
    mask = cols < hidden_size
    offsets = tl.cast(row, tl.int64) * hidden_size + cols
    x = tl.load(input_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        x += tl.load(residual_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        if store_residual:
            residual_dtype: tl.constexpr = residual_out_ptr.dtype.element_ty
            residual_out = round_to(x, residual_dtype).to(residual_dtype)
            tl.store(residual_out_ptr + offsets, residual_out, mask=mask)
    variance = tl.sum(x * x, axis=0) / hidden_size
    activation_dtype: tl.constexpr = input_ptr.dtype.element_ty
    normed = round_to(x * tl.rsqrt(variance + epsilon), activation_dtype)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = round_to(normed * weight, activation_dtype)  # (x.to(dtype) * weight) in the dtype
    y = round_to_e4m3(y / tl.load(scale_ptr), fp8_max)
    tl.store(result_ptr + offsets, y.to(result_ptr.dtype.element_ty), mask=mask)
