"""The FP8 GEMM ops behind ``Fp8LinearMethod``: the small-M GEMV on FP8 operands and its fused
forms, registered as ``torch.ops.pieceworks`` ops, with ``fp8_gemm`` as their torch form.

- ``fp8_gemm``: ``(x_fp8 * input_scale) @ (weight * weight_scale)^T + bias``, ``torch._scaled_mm``
  where the device has native FP8 GEMMs (``native``), else the dequantizing float32 reference;
- ``pieceworks::small_m_fp8_linear``: the Triton GEMV on the FP8 operands for at most 16 tokens (64
  for a weight of at most 12 MiB; ``triton_gemv.py``), on Hopper the resident-weight GEMV where it
  applies (``resident_gemv.py``), ``fp8_gemm`` above that;
- ``pieceworks::small_m_fp8_silu_and_mul``: the gate/up GEMV with ``silu(gate) * up`` and the down
  projection's static quantization as its epilogue (FP8 out);
- ``pieceworks::small_m_fp8_rope_linear``: the qkv GEMV with the rotary of the q and k heads as
  its epilogue (``triton_gemv_rope.py``).

The fused forms are what the fusion passes (``core/passes/gemv_fusion.py``) put into compiled
graphs; each falls back to ``fp8_gemm`` plus the torch form of its epilogue where its kernel does
not run. The ops are registered on first use (``register_small_m_fp8_ops``,
``small_m_fp8_rope_linear_op``), by the layer that calls them, before Dynamo traces it. The model
side (weights quantized after loading, the static input scale) is
``models/layers/quantization/fp8.py``.
"""

from __future__ import annotations

from typing import Any

import torch

from pieceworks.core.custom_op import direct_register_custom_op
from pieceworks.core.norm_quant import KERNEL_FP8_DTYPE
from pieceworks.kernels.gemv.resident_gemv import fp8_decode_gemv
from pieceworks.kernels.gemv.triton_gemv import launch_gemv, silu_and_mul_epilogue, uses_kernel
from pieceworks.kernels.gemv.triton_gemv_rope import (
    rope_epilogue,
    rotate_qk_heads,
    uses_rope_kernel,
)


def fp8_gemm(
    x_fp8: torch.Tensor,
    weight: torch.Tensor,
    input_scale: torch.Tensor,
    weight_scale: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None,
    native: bool,
) -> torch.Tensor:
    """``(x_fp8 * input_scale) @ (weight * weight_scale)^T + bias`` in ``out_dtype``; x is 2-D."""
    if native:
        # weight is (out, in) row-major, so weight.t() is the column-major operand cuBLAS wants.
        return torch._scaled_mm(
            x_fp8,
            weight.t(),
            scale_a=input_scale,
            scale_b=weight_scale,
            bias=bias,
            out_dtype=out_dtype,
        )
    output = torch.mm(x_fp8.to(torch.float32), weight.to(torch.float32).t())  # (T, out)
    output = (output * (input_scale * weight_scale)).to(out_dtype)
    return output if bias is None else output + bias


def small_m_fp8_linear(
    x_fp8: torch.Tensor,
    weight: torch.Tensor,
    input_scale: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    native: bool,
) -> torch.Tensor:
    """``fp8_gemm`` for 2-D x; the Triton GEMV on the FP8 operands when ``uses_kernel``."""
    if not uses_kernel(x_fp8, weight, (KERNEL_FP8_DTYPE,)):
        return fp8_gemm(x_fp8, weight, input_scale, weight_scale, out_dtype, bias, native)
    output = fp8_decode_gemv(x_fp8, weight, (input_scale, weight_scale), out_dtype)
    return output if bias is None else output + bias


def small_m_fp8_linear_fake(
    x_fp8: torch.Tensor,
    weight: torch.Tensor,
    input_scale: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    native: bool,
) -> torch.Tensor:
    return x_fp8.new_empty((x_fp8.shape[0], weight.shape[0]), dtype=out_dtype)


def small_m_fp8_silu_and_mul(
    x_fp8: torch.Tensor,
    weight: torch.Tensor,
    input_scale: torch.Tensor,
    weight_scale: torch.Tensor,
    out_scale: torch.Tensor,
    out_dtype: torch.dtype,
    native: bool,
) -> torch.Tensor:
    """``quant(silu_and_mul(fp8_gemm(...)), out_scale)`` for a merged [gate; up] weight: (T, I)
    in the platform's FP8 format; one GEMV with both as its epilogue when ``uses_kernel``."""
    if not uses_kernel(x_fp8, weight, (KERNEL_FP8_DTYPE,)):
        gate_up = fp8_gemm(x_fp8, weight, input_scale, weight_scale, out_dtype, None, native)
        return silu_and_mul_epilogue(gate_up, out_scale)
    scales = (input_scale, weight_scale)
    return launch_gemv(
        x_fp8, weight, scales=scales, gated=True, out_dtype=out_dtype, out_scale=out_scale
    )


def small_m_fp8_silu_and_mul_fake(
    x_fp8: torch.Tensor,
    weight: torch.Tensor,
    input_scale: torch.Tensor,
    weight_scale: torch.Tensor,
    out_scale: torch.Tensor,
    out_dtype: torch.dtype,
    native: bool,
) -> torch.Tensor:
    return x_fp8.new_empty((x_fp8.shape[0], weight.shape[0] // 2))


def small_m_fp8_rope_linear(
    x_fp8: torch.Tensor,
    weight: torch.Tensor,
    input_scale: torch.Tensor,
    weight_scale: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    head_size: int,
    num_rotary_heads: int,
    out_dtype: torch.dtype,
    native: bool,
) -> torch.Tensor:
    """``fp8_gemm`` for a merged qkv weight, its first ``num_rotary_heads`` heads rotated (neox,
    every dim) at ``positions (T,)``: (T, (Hq + 2 Hkv) D) in ``out_dtype``; one GEMV with the
    rotation as its epilogue when ``uses_rope_kernel`` (``kernels/gemv/triton_gemv_rope.py``)."""
    if not uses_rope_kernel(
        x_fp8, weight, cos_sin_cache, head_size, out_dtype, (KERNEL_FP8_DTYPE,)
    ):
        qkv = fp8_gemm(x_fp8, weight, input_scale, weight_scale, out_dtype, None, native)
        return rotate_qk_heads(positions, qkv, cos_sin_cache, head_size, num_rotary_heads)
    rope = rope_epilogue(positions, cos_sin_cache, head_size, num_rotary_heads)
    return fp8_decode_gemv(x_fp8, weight, (input_scale, weight_scale), out_dtype, rope)


def small_m_fp8_rope_linear_fake(
    x_fp8: torch.Tensor,
    weight: torch.Tensor,
    input_scale: torch.Tensor,
    weight_scale: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    head_size: int,
    num_rotary_heads: int,
    out_dtype: torch.dtype,
    native: bool,
) -> torch.Tensor:
    return x_fp8.new_empty((x_fp8.shape[0], weight.shape[0]), dtype=out_dtype)


def small_m_fp8_rope_linear_op() -> Any:
    """``torch.ops.pieceworks.small_m_fp8_rope_linear``, registered on first use."""
    return direct_register_custom_op(
        "small_m_fp8_rope_linear",
        small_m_fp8_rope_linear,
        mutates_args=[],
        fake_impl=small_m_fp8_rope_linear_fake,
    )


def register_small_m_fp8_ops() -> tuple[Any, Any]:
    """``(small_m_fp8_linear, small_m_fp8_silu_and_mul)`` as ``torch.ops.pieceworks`` ops,
    registered on first use (before Dynamo traces the first FP8 layer)."""
    linear = direct_register_custom_op(
        "small_m_fp8_linear",
        small_m_fp8_linear,
        mutates_args=[],
        fake_impl=small_m_fp8_linear_fake,
    )
    gated = direct_register_custom_op(
        "small_m_fp8_silu_and_mul",
        small_m_fp8_silu_and_mul,
        mutates_args=[],
        fake_impl=small_m_fp8_silu_and_mul_fake,
    )
    return linear, gated
