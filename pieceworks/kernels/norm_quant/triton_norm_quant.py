"""Triton kernel for the fused RMSNorm (+ residual add) + static FP8 quant ops.

One program per token row: load the row once, optionally add the residual (and store the sum),
reduce the mean square in float32, normalise, round to the activation dtype and multiply by the
weight exactly as ``core.norm_quant.rms_norm`` does, divide by the static scale, saturate to
+-448 and store ``float8_e4m3fn``. The whole row fits one block (``hidden_size`` up to 64K).
Every rounding goes through ``kernels/triton_rounding.py`` (round to nearest even): on a GPU the
hardware conversions, under the Triton interpreter float32 arithmetic (its own casts truncate to
bfloat16 and round float8 half up), so the kernel's bytes equal torch's on both. Under
programmatic dependent launch the norm weight and the scale are read before the wait, so only the
row's own loads follow the kernel before.
Tested on CPU under ``TRITON_INTERPRET=1`` against the torch reference; on GPUs it is the
implementation of the ops (``norm_quant_ops.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pieceworks.core.norm_quant import KERNEL_FP8_MAX
from pieceworks.kernels.triton_launch import launch, launch_options, pdl_start, programmatic_launch
from pieceworks.kernels.triton_rounding import round_to, round_to_e4m3


@triton.jit
def _rms_norm_quant_kernel(
    input_ptr,
    residual_ptr,
    weight_ptr,
    scale_ptr,
    result_ptr,
    residual_out_ptr,
    hidden_size,
    epsilon,
    fp8_max,
    BLOCK_SIZE: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    PDL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_SIZE)
    mask = cols < hidden_size
    offsets = row * hidden_size + cols
    # The norm weight and the scale are parameters, which no kernel writes: read before the wait
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    scale = tl.load(scale_ptr)
    if PDL:  # launched early (programmatic dependent launch): wait for the input's producer
        pdl_start()
    x = tl.load(input_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        x += tl.load(residual_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        residual_dtype: tl.constexpr = residual_out_ptr.dtype.element_ty
        residual_out = round_to(x, residual_dtype).to(residual_dtype)
        tl.store(residual_out_ptr + offsets, residual_out, mask=mask)
    variance = tl.sum(x * x, axis=0) / hidden_size
    activation_dtype: tl.constexpr = input_ptr.dtype.element_ty
    normed = round_to(x * tl.rsqrt(variance + epsilon), activation_dtype)
    y = round_to(normed * weight, activation_dtype)  # (x.to(dtype) * weight) in the dtype
    y = round_to_e4m3(y / scale, fp8_max)
    tl.store(result_ptr + offsets, y.to(result_ptr.dtype.element_ty), mask=mask)


def _launch(
    result: torch.Tensor,
    residual_out: torch.Tensor | None,
    input: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    scale: torch.Tensor,
    epsilon: float,
) -> None:
    hidden_size = input.shape[-1]
    for tensor in (result, input, residual, residual_out):
        if tensor is not None and not tensor.is_contiguous():
            raise ValueError("fused RMSNorm + FP8 quant needs contiguous (num_tokens, hidden) rows")
    num_rows = input.numel() // hidden_size
    block_size = triton.next_power_of_2(hidden_size)
    pdl = programmatic_launch(input.device)
    launch(
        _rms_norm_quant_kernel,
        (num_rows,),
        input,
        residual if residual is not None else input,  # unused without HAS_RESIDUAL
        weight,
        scale,
        result,
        residual_out if residual_out is not None else input,
        hidden_size,
        epsilon,
        KERNEL_FP8_MAX,
        BLOCK_SIZE=block_size,
        HAS_RESIDUAL=residual is not None,
        PDL=pdl,
        num_warps=min(max(block_size // 256, 1), 16),
        **launch_options(pdl),
    )


def rms_norm_static_fp8_quant(
    result: torch.Tensor,
    input: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    epsilon: float,
) -> None:
    """``result <- quant(rms_norm(input))`` (the op ``pieceworks::rms_norm_static_fp8_quant``)."""
    if input.shape[0] == 0:
        return
    _launch(result, None, input, None, weight, scale, epsilon)


def fused_add_rms_norm_static_fp8_quant(
    result: torch.Tensor,
    residual_out: torch.Tensor,
    input: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    epsilon: float,
) -> None:
    """``residual_out <- input + residual``; ``result <- quant(rms_norm(residual_out))``."""
    if input.shape[0] == 0:
        return
    _launch(result, residual_out, input, residual, weight, scale, epsilon)
