"""Rounding for Triton kernels to nearest even, with the same bytes on every backend.

A kernel that rounds with these before its final cast makes the cast itself exact, so its bytes
equal torch's under the Triton interpreter as on a GPU. On a GPU the hardware conversions round to
nearest even (and the e4m3 one saturates), so ``round_to`` and ``round_to_e4m3`` are a cast there
and back. Under the interpreter the casts are wrong (it truncates float32 -> bfloat16, and its
float8 cast rounds half up and loses the carry into the exponent: 7.96 becomes 4, 1.98 becomes
1), so there they round in float32 arithmetic instead (``round_to_bfloat16_bits``,
``round_to_e4m3_arithmetic``: a dozen or more instructions per value where a GPU needs one). Used
by the fused RMSNorm + FP8 quant kernel (``norm_quant/triton_norm_quant.py``), the GEMV's
epilogues (``triton_gemv.py``) and the decode attention's FP8 output
(``attention/triton_attention_tiles.py``). ``TRITON_DTYPES`` names the model dtypes for
``round_to``'s constexpr. ``tests/kernels/test_triton_rounding.py`` checks both forms against
torch's casts.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pieceworks.kernels.triton_device import INTERPRETED

TRITON_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}
_ARITHMETIC = tl.constexpr(INTERPRETED)  # the interpreter's casts do not round to nearest even


@triton.jit
def round_to(y, dtype: tl.constexpr):
    """float32 ``y`` rounded (nearest even) to ``dtype``'s precision, still float32."""
    if _ARITHMETIC and dtype == tl.bfloat16:
        return round_to_bfloat16_bits(y)
    else:
        return y.to(dtype).to(tl.float32)


@triton.jit
def round_to_e4m3(y, fp8_max):
    """``y`` saturated to +-fp8_max and rounded (nearest even) to an e4m3 value, in float32."""
    if _ARITHMETIC:
        return round_to_e4m3_arithmetic(y, fp8_max)
    else:
        return tl.minimum(tl.maximum(y, -fp8_max), fp8_max).to(tl.float8e4nv).to(tl.float32)


@triton.jit
def round_to_bfloat16_bits(y):
    """``round_to(y, tl.bfloat16)`` on the float32 bits: keep the top 16, rounding on the 17th
    (ties to the even 16th)."""
    bits = y.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def round_to_e4m3_arithmetic(y, fp8_max):
    """``round_to_e4m3`` in float32 arithmetic."""
    magnitude = tl.minimum(tl.abs(y), fp8_max)
    # e4m3: 3 mantissa bits, so values in [2^e, 2^(e+1)) are spaced 2^(e-3); below the smallest
    # normal 2^-6 the subnormals keep the spacing 2^-9.
    exponent = tl.math.floor(tl.math.log2(tl.maximum(magnitude, 0.015625)))
    step = tl.math.exp2(exponent - 3.0)
    # magnitude / step <= 16: adding and removing 1.5 * 2^23 rounds it to an integer (nearest even)
    magnitude = ((magnitude / step + 12582912.0) - 12582912.0) * step
    # y's sign bit on the magnitude's bits: keeps -0.0 where a value rounds to zero (triton 3.6's
    # interpreter negates as 0 - x, which loses it)
    sign = y.to(tl.uint32, bitcast=True) & 0x80000000
    return (magnitude.to(tl.uint32, bitcast=True) | sign).to(tl.float32, bitcast=True)
