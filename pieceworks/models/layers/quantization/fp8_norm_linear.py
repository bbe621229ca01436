"""The FP8 GEMV with the RMSNorm (+ residual add) + quantization of its input as its prologue.

``pieceworks::small_m_fp8_add_rms_norm_linear`` is what the pass ``GemvNormFoldPass``
(``core/passes/gemv_norm_fold.py``) turns the pair "fused add + RMSNorm + static FP8 quant, then
one of the small-M FP8 GEMV ops" into. Why: in an FP8 decode graph the norm before ``qkv_proj``
and before ``gate_up_proj`` is a kernel of its own (Inductor's, or the fused op's), about 2.5 µs
each on an H200 for a 4096-wide row, plus the gap to the next launch. Here each GEMV program
computes the normalised, quantized row itself (``triton_gemv.py``, ``NORM``: into its own slot
of a small scratch, before its K loop, which stays as it was), and one program stores the
residual sum: two kernels fewer per decoder layer.

``epilogue`` names the GEMV op the pair replaced and which of the trailing arguments count:
``"linear"`` (``small_m_fp8_linear``: ``bias``), ``"silu_and_mul"``
(``small_m_fp8_silu_and_mul``: ``out_scale``), ``"rope"`` (``small_m_fp8_rope_linear``:
``positions``, ``cos_sin_cache``, ``head_size``, ``num_rotary_heads``). The op returns
``(output, residual_out)``: the replaced GEMV op's result and ``input + residual``. Where the
kernel does not run (more than ``MAX_GEMV_TOKENS`` tokens, no GPU Triton targets, a shape the
epilogue does not take) it runs the two replaced ops one after the other: the same values.
"""

from __future__ import annotations

from typing import Any

import torch

from pieceworks.core.custom_op import direct_register_custom_op
from pieceworks.core.norm_quant import FP8_DTYPE, FUSED_ADD_RMS_NORM_QUANT_OP, GEMV_NORM_OP
from pieceworks.models.layers import triton_launch
from pieceworks.models.layers.quantization.fp8 import (
    small_m_fp8_linear,
    small_m_fp8_rope_linear,
    small_m_fp8_silu_and_mul,
)
from pieceworks.models.layers.triton_gemv import MAX_GEMV_TOKENS, NormPrologue, launch_gemv
from pieceworks.models.layers.triton_gemv_rope import rope_epilogue, rope_fits

EPILOGUES = ("linear", "silu_and_mul", "rope")


def uses_norm_kernel(
    input: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    epilogue: str,
    cos_sin_cache: torch.Tensor | None,
    head_size: int,
    out_dtype: torch.dtype,
) -> bool:
    """Whether the op runs the GEMV with its norm prologue for these operands (else the two ops)."""
    fits = (
        0 < input.shape[0] <= MAX_GEMV_TOKENS
        and weight.dtype == FP8_DTYPE
        and weight.stride(1) == 1
        and input.is_contiguous()
        and residual.is_contiguous()
        and triton_launch.kernel_runs_on(input)
    )
    if epilogue != "rope":
        return fits
    assert cos_sin_cache is not None
    return fits and rope_fits(weight, cos_sin_cache, head_size, out_dtype)


def small_m_fp8_add_rms_norm_linear(
    input: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    epsilon: float,
    weight: torch.Tensor,
    input_scale: torch.Tensor,
    weight_scale: torch.Tensor,
    epilogue: str,
    bias: torch.Tensor | None,
    out_scale: torch.Tensor | None,
    positions: torch.Tensor | None,
    cos_sin_cache: torch.Tensor | None,
    head_size: int,
    num_rotary_heads: int,
    out_dtype: torch.dtype,
    native: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(gemv(quant(rms_norm(input + residual), input_scale)), input + residual)``, the GEMV
    being the small-M FP8 op ``epilogue`` names (module docstring); input and residual (T, K)."""
    if epilogue not in EPILOGUES:
        raise ValueError(f"epilogue {epilogue!r} is not one of {EPILOGUES}")
    residual_out = torch.empty_like(input)
    if uses_norm_kernel(input, residual, weight, epilogue, cos_sin_cache, head_size, out_dtype):
        norm = NormPrologue(input, residual, norm_weight, epsilon, residual_out)
        rope = None
        if epilogue == "rope":
            assert positions is not None and cos_sin_cache is not None
            rope = rope_epilogue(positions, cos_sin_cache, head_size, num_rotary_heads)
        output = launch_gemv(
            None,
            weight,
            scales=(input_scale, weight_scale),
            gated=epilogue == "silu_and_mul",
            rope=rope,
            out_dtype=out_dtype,
            out_scale=out_scale,
            norm=norm,
        )
        return (output if bias is None else output + bias), residual_out
    x_fp8 = torch.empty(input.shape, dtype=FP8_DTYPE, device=input.device)
    fused_norm = getattr(torch.ops.pieceworks, FUSED_ADD_RMS_NORM_QUANT_OP)
    fused_norm(x_fp8, residual_out, input, residual, norm_weight, input_scale, epsilon)
    operands = (x_fp8, weight, input_scale, weight_scale)
    if epilogue == "linear":
        output = small_m_fp8_linear(*operands, bias, out_dtype, native)
    elif epilogue == "silu_and_mul":
        assert out_scale is not None
        output = small_m_fp8_silu_and_mul(*operands, out_scale, out_dtype, native)
    else:
        assert positions is not None and cos_sin_cache is not None
        rope_args = (positions, cos_sin_cache, head_size, num_rotary_heads)
        output = small_m_fp8_rope_linear(*operands, *rope_args, out_dtype, native)
    return output, residual_out


def small_m_fp8_add_rms_norm_linear_fake(
    input: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    epsilon: float,
    weight: torch.Tensor,
    input_scale: torch.Tensor,
    weight_scale: torch.Tensor,
    epilogue: str,
    bias: torch.Tensor | None,
    out_scale: torch.Tensor | None,
    positions: torch.Tensor | None,
    cos_sin_cache: torch.Tensor | None,
    head_size: int,
    num_rotary_heads: int,
    out_dtype: torch.dtype,
    native: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    num_tokens = input.shape[0]
    if epilogue == "silu_and_mul":
        output = input.new_empty((num_tokens, weight.shape[0] // 2), dtype=FP8_DTYPE)
    else:
        output = input.new_empty((num_tokens, weight.shape[0]), dtype=out_dtype)
    return output, torch.empty_like(input)


def small_m_fp8_add_rms_norm_linear_op() -> Any:
    """``torch.ops.pieceworks.small_m_fp8_add_rms_norm_linear``, registered on first use (by
    ``Fp8LinearMethod`` where the small-M GEMV is on, before any graph is compiled)."""
    return direct_register_custom_op(
        GEMV_NORM_OP,
        small_m_fp8_add_rms_norm_linear,
        mutates_args=[],
        fake_impl=small_m_fp8_add_rms_norm_linear_fake,
    )
