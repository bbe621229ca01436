"""RMSNorm and static FP8 quantization as the compile pipeline knows them, and their fused ops.

The fusion pass (``core/passes/fusion.py``) rewrites "RMSNorm (+ residual add) followed by static
FP8 quantization" into one fused op. It matches the ATen sequence these functions trace to, so
the layers call these very functions (``models/layers/layernorm.py``,
``models/layers/quantization``): a change to the norm's arithmetic changes the pattern with it and
cannot silently stop the fusion.
This module also holds the fused ops' names and their torch reference semantics; the ops are
registered, with a Triton kernel where the platform runs FP8, in
``models/layers/quantization/norm_quant_ops.py`` (kernels belong to the models layer).

Shapes: activations ``(num_tokens, hidden_size)``; ``weight (hidden_size,)``; ``scale`` a 0-d
float32 tensor (per-tensor scale: ``x ~= x_fp8 * scale``).
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448.0

# Fused ops in pieceworks' library namespace (``torch.ops.pieceworks.<name>``). Both write into
# output buffers they are given and mutate nothing else, so rewriting their functionalized form
# back into an in-place call (``FixFunctionalizationPass``) can never clobber a live tensor.
RMS_NORM_QUANT_OP = "rms_norm_static_fp8_quant"
FUSED_ADD_RMS_NORM_QUANT_OP = "fused_add_rms_norm_static_fp8_quant"


def rms_norm(x: torch.Tensor, weight: torch.Tensor, epsilon: float) -> torch.Tensor:
    """``weight * x / sqrt(mean(x**2) + eps)``: computed in float32, cast back before ``weight``."""
    orig_dtype = x.dtype
    x = x.to(torch.float32)
    variance = x.pow(2).mean(dim=-1, keepdim=True)  # (T, 1)
    x = x * torch.rsqrt(variance + epsilon)
    return x.to(orig_dtype) * weight


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


def static_scaled_fp8_quant(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x / scale`` saturated to +-448 and rounded to ``float8_e4m3fn`` (scale: static, 0-d)."""
    x_scaled = x.to(torch.float32) / scale
    return x_scaled.clamp(min=-FP8_MAX, max=FP8_MAX).to(FP8_DTYPE)


def rms_norm_static_fp8_quant_reference(
    result: torch.Tensor,
    input: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    epsilon: float,
) -> None:
    """The fused op's meaning: ``result <- quant(rms_norm(input))``."""
    result.copy_(static_scaled_fp8_quant(rms_norm(input, weight, epsilon), scale))


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
    result.copy_(static_scaled_fp8_quant(normed, scale))
    residual_out.copy_(new_residual)
