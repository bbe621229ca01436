"""RMSNorm and static FP8 quantization as the compile pipeline knows them, and their fused ops.

The fusion pass (``core/passes/fusion.py``) rewrites "RMSNorm (+ residual add) followed by static
FP8 quantization" into one fused op. It matches the ATen sequence these functions trace to, so
the layers call these very functions (``models/layers/layernorm.py``,
``models/layers/quantization``): a change to the norm's arithmetic changes the pattern with it and
cannot silently stop the fusion.
This module also holds the fused ops' names and their torch reference semantics; the ops are
registered, with a Triton kernel where the platform runs FP8, in
``kernels/norm_quant/norm_quant_ops.py`` (beside their kernel).

Shapes: activations ``(num_tokens, hidden_size)``; ``weight (hidden_size,)``; ``scale`` a 0-d
float32 tensor (per-tensor scale: ``x ~= x_fp8 * scale``).

FP8 format: values are quantized to the e4m3 flavour the platform's device converts
(``fp8_dtype()``, from ``DeviceCapability.fp8_dtype``): ``float8_e4m3fn`` (max 448) on NVIDIA, the
CPU and OCP devices, ``float8_e4m3fnuz`` (max 240) on AMD's MI300 family (gfx94x). pieceworks'
Triton FP8 kernels read and write ``KERNEL_FP8_DTYPE`` (e4m3fn) only; where the platform's format
is another (``kernels_take_fp8()`` is false) the FP8 layers take their torch forms.
"""

from __future__ import annotations

import torch

# The format pieceworks' Triton FP8 kernels read and write (``tl.float8e4nv``).
KERNEL_FP8_DTYPE = torch.float8_e4m3fn
KERNEL_FP8_MAX = float(torch.finfo(KERNEL_FP8_DTYPE).max)  # 448.0

# Fused ops in pieceworks' library namespace (``torch.ops.pieceworks.<name>``). Both write into
# output buffers they are given and mutate nothing else, so rewriting their functionalized form
# back into an in-place call (``FixFunctionalizationPass``) can never clobber a live tensor.
RMS_NORM_QUANT_OP = "rms_norm_static_fp8_quant"
FUSED_ADD_RMS_NORM_QUANT_OP = "fused_add_rms_norm_static_fp8_quant"


def fp8_dtype() -> torch.dtype:
    """The FP8 format of the current platform's device (``DeviceCapability.fp8_dtype``)."""
    from pieceworks.platforms import current_platform

    return current_platform().device_capability().fp8_dtype


def fp8_max(dtype: torch.dtype | None = None) -> float:
    """The largest finite value of ``dtype`` (default: the platform's FP8 format): 448 for
    e4m3fn, 240 for e4m3fnuz."""
    return float(torch.finfo(dtype or fp8_dtype()).max)


def kernels_take_fp8() -> bool:
    """Whether the platform's FP8 format is the one pieceworks' Triton FP8 kernels use."""
    return fp8_dtype() == KERNEL_FP8_DTYPE


def rms_norm(x: torch.Tensor, weight: torch.Tensor, epsilon: float) -> torch.Tensor:
    """``weight * x / sqrt(mean(x**2) + eps)``: computed in float32, cast back before ``weight``."""
    orig_dtype = x.dtype
    x = x.to(torch.float32)
    variance = x.pow(2).mean(dim=-1, keepdim=True)  # (T, 1)
    x = x * torch.rsqrt(variance + epsilon)
    return x.to(orig_dtype) * weight


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, epsilon: float) -> torch.Tensor:
    """Gemma's ``x / sqrt(mean(x**2) + eps) * (1 + weight)``, all in float32, cast back once."""
    orig_dtype = x.dtype
    x = x.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + epsilon)
    return (x * (1.0 + weight.to(torch.float32))).to(orig_dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, epsilon: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual), x + residual)``; the sum is normalised before it is rounded."""
    orig_dtype = x.dtype
    x = x.to(torch.float32) + residual.to(torch.float32)
    residual = x.to(orig_dtype)
    variance = x.pow(2).mean(dim=-1, keepdim=True)  # (T, 1)
    x = x * torch.rsqrt(variance + epsilon)
    return x.to(orig_dtype) * weight, residual


def static_scaled_fp8_quant(
    x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """``x / scale`` saturated to the format's max and rounded to ``dtype`` (default: the
    platform's FP8 format, ``fp8_dtype()``; scale: static, 0-d)."""
    dtype = dtype or fp8_dtype()
    bound = fp8_max(dtype)
    return (x.to(torch.float32) / scale).clamp(min=-bound, max=bound).to(dtype)


def rms_norm_static_fp8_quant_reference(
    result: torch.Tensor,
    input: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    epsilon: float,
) -> None:
    """The fused op's meaning: ``result <- quant(rms_norm(input))`` in ``result``'s format."""
    result.copy_(static_scaled_fp8_quant(rms_norm(input, weight, epsilon), scale, result.dtype))


def fused_add_rms_norm_static_fp8_quant_reference(
    result: torch.Tensor,
    residual_out: torch.Tensor,
    input: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    epsilon: float,
) -> None:
    """``residual_out <- input + residual``; ``result <- quant(rms_norm(input + residual))``."""
    normed, new_residual = add_rms_norm(input, residual, weight, epsilon)
    result.copy_(static_scaled_fp8_quant(normed, scale, result.dtype))
    residual_out.copy_(new_residual)
