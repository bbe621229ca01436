"""The FP8 GEMV with the residual add + RMSNorm + static FP8 quant after it as its epilogue.

``LinearNormFoldPass`` (``core/passes/linear_norm_fold.py``) rewrites

    y = small_m_fp8_linear(x_fp8, W, input_scale, weight_scale, None, dtype, native)
    result, residual_out = fused_add_rms_norm_static_fp8_quant(y, residual, w, scale, eps)

into one call of ``small_m_fp8_linear_add_rms_norm``, which returns ``(result, residual_out)``:
on the GPU one GEMV launch whose epilogue adds the residual and whose last program normalises
and quantizes the row (``layers/triton_gemv_norm.py`` says how and why), so the norm costs no
kernel of its own. Past ``MAX_NORM_TAIL_TOKENS`` tokens (the tail is one program, which walks the
tokens one by one), or where the kernel does not run, it runs the two ops it replaced.
"""

from __future__ import annotations

from typing import Any

import torch

from pieceworks.core.custom_op import direct_register_custom_op
from pieceworks.core.norm_quant import (
    FP8_DTYPE,
    FUSED_ADD_RMS_NORM_QUANT_OP,
    LINEAR_NORM_OP,
    num_partials,
)
from pieceworks.models.layers.quantization.fp8 import small_m_fp8_linear
from pieceworks.models.layers.triton_gemv import launch_gemv, uses_kernel
from pieceworks.models.layers.triton_gemv_norm import ResidualNorm

# Tokens up to which the norm runs as the GEMV's tail (measured at 1 on the H200; the tail's
# program handles one token after the other, while the fused kernel runs one program per token).
MAX_NORM_TAIL_TOKENS = 4


def uses_norm_tail(
    x_fp8: torch.Tensor,
    weight: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    out_dtype: torch.dtype,
) -> bool:
    """Whether the op runs the GEMV with the norm as its tail (else the two ops)."""
    return (
        x_fp8.shape[0] <= MAX_NORM_TAIL_TOKENS
        and uses_kernel(x_fp8, weight, (FP8_DTYPE,))
        and residual.dtype == out_dtype == norm_weight.dtype  # the norm rounds to the model dtype
        and residual.is_contiguous()
        and norm_weight.is_contiguous()
    )


def small_m_fp8_linear_add_rms_norm(
    x_fp8: torch.Tensor,
    weight: torch.Tensor,
    input_scale: torch.Tensor,
    weight_scale: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    epsilon: float,
    scale: torch.Tensor,
    out_dtype: torch.dtype,
    native: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(quant(rms_norm(y + residual), scale), y + residual)`` with ``y`` the small-M FP8 GEMV
    of ``x_fp8`` (``small_m_fp8_linear`` without bias), both (T, N)."""
    if not uses_norm_tail(x_fp8, weight, residual, norm_weight, out_dtype):
        output = small_m_fp8_linear(x_fp8, weight, input_scale, weight_scale, None, out_dtype,
                                    native)  # fmt: skip
        result = torch.empty(output.shape, dtype=FP8_DTYPE, device=output.device)
        residual_out = torch.empty_like(output)
        fused_norm = getattr(torch.ops.pieceworks, FUSED_ADD_RMS_NORM_QUANT_OP)
        fused_norm(result, residual_out, output, residual, norm_weight, scale, epsilon)
        return result, residual_out
    num_tokens, hidden_size = residual.shape
    sums = torch.empty(residual.shape, dtype=torch.float32, device=residual.device)
    partials = sums.new_empty((num_tokens, num_partials(hidden_size)))
    result = torch.empty(residual.shape, dtype=FP8_DTYPE, device=residual.device)
    norm = ResidualNorm(residual, sums, partials, norm_weight, epsilon, scale, result)
    residual_out = launch_gemv(
        x_fp8, weight, scales=(input_scale, weight_scale), out_dtype=out_dtype, residual=norm
    )
    return result, residual_out


def small_m_fp8_linear_add_rms_norm_fake(
    x_fp8: torch.Tensor,
    weight: torch.Tensor,
    input_scale: torch.Tensor,
    weight_scale: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    epsilon: float,
    scale: torch.Tensor,
    out_dtype: torch.dtype,
    native: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(residual, dtype=FP8_DTYPE), torch.empty_like(residual)


def small_m_fp8_linear_add_rms_norm_op() -> Any:
    """``torch.ops.pieceworks.small_m_fp8_linear_add_rms_norm``, registered on first use (by
    ``Fp8LinearMethod`` where the small-M GEMV is on, before any graph is compiled)."""
    return direct_register_custom_op(
        LINEAR_NORM_OP,
        small_m_fp8_linear_add_rms_norm,
        mutates_args=[],
        fake_impl=small_m_fp8_linear_add_rms_norm_fake,
    )
