"""Registers the fused RMSNorm + static FP8 quant ops that ``core/passes/fusion.py`` emits.

``pieceworks::rms_norm_static_fp8_quant(result, input, weight, scale, epsilon)`` and
``pieceworks::fused_add_rms_norm_static_fp8_quant(result, residual_out, input, residual, weight,
scale, epsilon)`` write into ``result`` (and ``residual_out``) only. Where the platform runs FP8
natively in the kernels' format (e4m3fn) the implementation is the Triton kernel
(``triton_norm_quant.py``); elsewhere (the CPU, MI300's e4m3fnuz) it is the
torch reference from ``core/norm_quant.py``, which defines what the ops mean. Registered lazily,
when the first FP8 layer is built (registration resolves the platform's dispatch key).
"""

from __future__ import annotations

import torch

from pieceworks.core.custom_op import direct_register_custom_op
from pieceworks.core.norm_quant import (
    FUSED_ADD_RMS_NORM_QUANT_OP,
    RMS_NORM_QUANT_OP,
    fused_add_rms_norm_static_fp8_quant_reference,
    kernels_take_fp8,
    rms_norm_static_fp8_quant_reference,
)
from pieceworks.platforms.capability import FP8_GEMM


def _rms_norm_quant_fake(
    result: torch.Tensor,
    input: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    epsilon: float,
) -> None:
    return None


def _fused_add_rms_norm_quant_fake(
    result: torch.Tensor,
    residual_out: torch.Tensor,
    input: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    epsilon: float,
) -> None:
    return None


def register_norm_quant_ops() -> None:
    """Register both ops (idempotent): Triton where FP8 is native in e4m3fn, else the torch
    reference (which writes the result's own format)."""
    from pieceworks.platforms import current_platform

    plain, with_add = (
        rms_norm_static_fp8_quant_reference,
        fused_add_rms_norm_static_fp8_quant_reference,
    )
    if current_platform().device_capability().has(FP8_GEMM) and kernels_take_fp8():
        from pieceworks.kernels.norm_quant import triton_norm_quant

        plain = triton_norm_quant.rms_norm_static_fp8_quant
        with_add = triton_norm_quant.fused_add_rms_norm_static_fp8_quant
    direct_register_custom_op(
        RMS_NORM_QUANT_OP, plain, mutates_args=["result"], fake_impl=_rms_norm_quant_fake
    )
    direct_register_custom_op(
        FUSED_ADD_RMS_NORM_QUANT_OP,
        with_add,
        mutates_args=["result", "residual_out"],
        fake_impl=_fused_add_rms_norm_quant_fake,
    )
