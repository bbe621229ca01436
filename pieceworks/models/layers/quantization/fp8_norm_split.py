"""The FP8 GEMVs that share a residual add + RMSNorm + static FP8 quant between them.

``NormSplitPass`` (``core/passes/norm_split.py``) rewrites

    y = small_m_fp8_linear(x_fp8, W1, ...)                       # the producer
    result, residual_out = fused_add_rms_norm_static_fp8_quant(y, residual, w, s, eps)
    z = <small-M FP8 GEMV op>(result, W2, s, ...)                # the consumer

into

    residual_out, sums, partials = small_m_fp8_linear_add(x_fp8, W1, ..., residual)
    z = small_m_fp8_normed_linear(sums, partials, w, eps, W2, s, ...)

so the norm costs no kernel of its own: the producer's epilogue adds the residual and sums the
squares of its columns, the consumer normalises and quantizes its input chunk by chunk inside
its K loop (``layers/triton_gemv_norm.py`` says how and why). ``sums`` is the float32
``y + residual`` and ``partials`` (T, ceil(N / 64)) the sums of its squares over each 64 columns.
``epilogue`` names the consumer op replaced: ``"linear"`` (``small_m_fp8_linear``),
``"silu_and_mul"`` (``small_m_fp8_silu_and_mul``: ``out_scale``), ``"rope"``
(``small_m_fp8_rope_linear``: ``positions``, ``cos_sin_cache``, ``head_size``,
``num_rotary_heads``). Where the kernels do not run (more than ``MAX_GEMV_TOKENS`` tokens, no GPU
Triton targets, a shape they do not take) each op computes the same values with torch and the
replaced GEMV op.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from pieceworks.core.custom_op import direct_register_custom_op
from pieceworks.core.norm_quant import (
    FP8_DTYPE,
    LINEAR_ADD_OP,
    NORM_PARTIAL_WIDTH,
    NORMED_LINEAR_OP,
    num_partials,
    static_scaled_fp8_quant,
)
from pieceworks.models.layers import triton_launch
from pieceworks.models.layers.quantization.fp8 import (
    fp8_gemm,
    small_m_fp8_linear,
    small_m_fp8_rope_linear,
    small_m_fp8_silu_and_mul,
)
from pieceworks.models.layers.triton_gemv import MAX_GEMV_TOKENS, launch_gemv, uses_kernel
from pieceworks.models.layers.triton_gemv_norm import AddResidual, InputNorm
from pieceworks.models.layers.triton_gemv_rope import rope_epilogue, rope_fits

EPILOGUES = ("linear", "silu_and_mul", "rope")


def residual_sums(
    output: torch.Tensor, residual: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(residual_out, sums, partials)`` of a GEMM's ``output`` and the residual, in torch."""
    sums = output.to(torch.float32) + residual.to(torch.float32)
    num_tokens, hidden_size = sums.shape
    padding = num_partials(hidden_size) * NORM_PARTIAL_WIDTH - hidden_size
    squares = F.pad(sums * sums, (0, padding)).view(num_tokens, -1, NORM_PARTIAL_WIDTH)
    return sums.to(output.dtype, copy=True), sums, squares.sum(dim=-1)  # never sums itself


def small_m_fp8_linear_add(
    x_fp8: torch.Tensor,
    weight: torch.Tensor,
    input_scale: torch.Tensor,
    weight_scale: torch.Tensor,
    residual: torch.Tensor,
    out_dtype: torch.dtype,
    native: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``small_m_fp8_linear(...) + residual`` as ``(residual_out, sums, partials)`` (module
    docstring); the GEMV with the residual epilogue when its kernel runs."""
    fits = (
        uses_kernel(x_fp8, weight, (FP8_DTYPE,))
        and residual.dtype == out_dtype
        and residual.is_contiguous()
    )
    if not fits:
        output = fp8_gemm(x_fp8, weight, input_scale, weight_scale, out_dtype, None, native)
        return residual_sums(output, residual)
    num_tokens, hidden_size = residual.shape
    sums = torch.empty(residual.shape, dtype=torch.float32, device=residual.device)
    partials = sums.new_empty((num_tokens, num_partials(hidden_size)))
    output = launch_gemv(
        x_fp8,
        weight,
        scales=(input_scale, weight_scale),
        out_dtype=out_dtype,
        residual=AddResidual(residual, sums, partials),
    )
    return output, sums, partials


def small_m_fp8_linear_add_fake(
    x_fp8: torch.Tensor,
    weight: torch.Tensor,
    input_scale: torch.Tensor,
    weight_scale: torch.Tensor,
    residual: torch.Tensor,
    out_dtype: torch.dtype,
    native: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    num_tokens, hidden_size = residual.shape
    sums = residual.new_empty((num_tokens, hidden_size), dtype=torch.float32)
    partials = residual.new_empty((num_tokens, num_partials(hidden_size)), dtype=torch.float32)
    return torch.empty_like(residual), sums, partials


def normed_fp8_input(
    sums: torch.Tensor,
    partials: torch.Tensor,
    norm_weight: torch.Tensor,
    epsilon: float,
    input_scale: torch.Tensor,
) -> torch.Tensor:
    """``quant(rms_norm(sums))`` from the partial sums, rounded as ``core.norm_quant`` rounds."""
    variance = partials.sum(dim=-1, keepdim=True) / sums.shape[-1]  # (T, 1)
    normed = (sums * torch.rsqrt(variance + epsilon)).to(norm_weight.dtype) * norm_weight
    return static_scaled_fp8_quant(normed, input_scale)


def uses_norm_kernel(
    sums: torch.Tensor,
    partials: torch.Tensor,
    norm_weight: torch.Tensor,
    weight: torch.Tensor,
    epilogue: str,
    cos_sin_cache: torch.Tensor | None,
    head_size: int,
    out_dtype: torch.dtype,
) -> bool:
    """Whether the consumer runs the GEMV with the input norm (else torch and the GEMV op)."""
    fits = (
        0 < sums.shape[0] <= MAX_GEMV_TOKENS
        and weight.dtype == FP8_DTYPE
        and weight.stride(1) == 1
        and norm_weight.dtype == out_dtype  # the norm rounds to the model dtype
        and sums.is_contiguous()
        and partials.is_contiguous()
        and triton_launch.kernel_runs_on(sums)
    )
    if epilogue != "rope":
        return fits
    assert cos_sin_cache is not None
    return fits and rope_fits(weight, cos_sin_cache, head_size, out_dtype)


def small_m_fp8_normed_linear(
    sums: torch.Tensor,
    partials: torch.Tensor,
    norm_weight: torch.Tensor,
    epsilon: float,
    weight: torch.Tensor,
    input_scale: torch.Tensor,
    weight_scale: torch.Tensor,
    epilogue: str,
    out_scale: torch.Tensor | None,
    positions: torch.Tensor | None,
    cos_sin_cache: torch.Tensor | None,
    head_size: int,
    num_rotary_heads: int,
    out_dtype: torch.dtype,
    native: bool,
) -> torch.Tensor:
    """The GEMV op ``epilogue`` names, on ``quant(rms_norm(sums), input_scale)`` (module
    docstring); the GEMV with the input norm when its kernel runs."""
    if epilogue not in EPILOGUES:
        raise ValueError(f"epilogue {epilogue!r} is not one of {EPILOGUES}")
    if epilogue == "silu_and_mul" and out_scale is None:
        raise ValueError("the silu_and_mul epilogue needs out_scale")
    if epilogue == "rope" and (positions is None or cos_sin_cache is None):
        raise ValueError("the rope epilogue needs positions and cos_sin_cache")
    kernel = uses_norm_kernel(
        sums, partials, norm_weight, weight, epilogue, cos_sin_cache, head_size, out_dtype
    )
    if kernel:
        rope = None
        if epilogue == "rope":
            assert positions is not None and cos_sin_cache is not None
            rope = rope_epilogue(positions, cos_sin_cache, head_size, num_rotary_heads)
        return launch_gemv(
            sums,
            weight,
            scales=(input_scale, weight_scale),
            gated=epilogue == "silu_and_mul",
            rope=rope,
            out_dtype=out_dtype,
            out_scale=out_scale,
            norm=InputNorm(partials, norm_weight, epsilon),
        )
    x_fp8 = normed_fp8_input(sums, partials, norm_weight, epsilon, input_scale)
    operands = (x_fp8, weight, input_scale, weight_scale)
    if epilogue == "linear":
        return small_m_fp8_linear(*operands, None, out_dtype, native)
    if epilogue == "silu_and_mul":
        assert out_scale is not None
        return small_m_fp8_silu_and_mul(*operands, out_scale, out_dtype, native)
    assert positions is not None and cos_sin_cache is not None
    rope_args = (positions, cos_sin_cache, head_size, num_rotary_heads)
    return small_m_fp8_rope_linear(*operands, *rope_args, out_dtype, native)


def small_m_fp8_normed_linear_fake(
    sums: torch.Tensor,
    partials: torch.Tensor,
    norm_weight: torch.Tensor,
    epsilon: float,
    weight: torch.Tensor,
    input_scale: torch.Tensor,
    weight_scale: torch.Tensor,
    epilogue: str,
    out_scale: torch.Tensor | None,
    positions: torch.Tensor | None,
    cos_sin_cache: torch.Tensor | None,
    head_size: int,
    num_rotary_heads: int,
    out_dtype: torch.dtype,
    native: bool,
) -> torch.Tensor:
    num_tokens = sums.shape[0]
    if epilogue == "silu_and_mul":
        return sums.new_empty((num_tokens, weight.shape[0] // 2), dtype=FP8_DTYPE)
    return sums.new_empty((num_tokens, weight.shape[0]), dtype=out_dtype)


def register_norm_split_ops() -> tuple[Any, Any]:
    """``(small_m_fp8_linear_add, small_m_fp8_normed_linear)`` as ``torch.ops.pieceworks`` ops,
    registered on first use (by ``Fp8LinearMethod`` where the small-M GEMV is on, before any
    graph is compiled: ``NormSplitPass`` rewrites into them)."""
    linear_add = direct_register_custom_op(
        LINEAR_ADD_OP,
        small_m_fp8_linear_add,
        mutates_args=[],
        fake_impl=small_m_fp8_linear_add_fake,
    )
    normed_linear = direct_register_custom_op(
        NORMED_LINEAR_OP,
        small_m_fp8_normed_linear,
        mutates_args=[],
        fake_impl=small_m_fp8_normed_linear_fake,
    )
    return linear_add, normed_linear
