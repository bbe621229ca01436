"""``silu_and_mul_epilogue``: the gated GEMV's epilogue as a kernel of its own.

For products the GEMV does not take (more tokens than ``max_gemv_tokens``) the gated ops
(``pieceworks::small_m_silu_and_mul_linear`` and its FP8 form) run the GEMM and then this: one
Triton launch computing ``silu(gate) * up`` (and the static FP8 quantization of the result),
because inside the opaque op Inductor cannot fuse the activation and eager torch would take
several launches per layer.

``pieceworks::silu_and_mul(x)`` (``silu_and_mul_op``) is the activation alone as one opaque op:
what ``SiluAndMul`` calls where the chooser gives ``silu_and_mul`` this kernel, so that the
gate/up GEMV fusion pass (``core/passes/gemv_fusion.py``) finds it in the graph.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from pieceworks.core.custom_op import direct_register_custom_op
from pieceworks.core.norm_quant import (
    KERNEL_FP8_DTYPE,
    KERNEL_FP8_MAX,
    fp8_dtype,
    static_scaled_fp8_quant,
)
from pieceworks.kernels import triton_device
from pieceworks.kernels.activation.torch_activation import silu_and_mul
from pieceworks.kernels.triton_launch import launch
from pieceworks.kernels.triton_rounding import round_to_e4m3

_FP8_MAX = tl.constexpr(KERNEL_FP8_MAX)


@triton.jit
def _silu_and_mul_kernel(
    gate_up_ptr,
    out_ptr,
    out_scale_ptr,
    out_features,
    stride_in,
    stride_out,
    BLOCK: tl.constexpr,
    QUANT_OUT: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    columns = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = columns < out_features
    row = gate_up_ptr + token * stride_in
    gate = tl.load(row + columns, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(row + out_features + columns, mask=mask, other=0.0).to(tl.float32)
    result = gate / (1.0 + tl.exp(-gate)) * up
    if QUANT_OUT:
        result = round_to_e4m3(result / tl.load(out_scale_ptr), _FP8_MAX)
    tl.store(out_ptr + token * stride_out + columns, result.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul_epilogue(gate_up: torch.Tensor, out_scale: torch.Tensor | None) -> torch.Tensor:
    """The gated GEMV's epilogue alone, for products the GEMV does not take (more than 16
    tokens): ``silu_and_mul(gate_up)``, quantized with ``out_scale`` if given, in one kernel where
    ``kernel_runs_on`` (inside the op Inductor cannot fuse it), else in torch. The quantized
    result is in the platform's FP8 format; the kernel writes only ``KERNEL_FP8_DTYPE``."""
    quant_dtype = fp8_dtype() if out_scale is not None else None
    kernel_writes = quant_dtype in (None, KERNEL_FP8_DTYPE)
    if not (kernel_writes and triton_device.kernel_runs_on(gate_up)) or gate_up.stride(1) != 1:
        activated = silu_and_mul(gate_up.float() if out_scale is not None else gate_up)
        if out_scale is None:
            return activated
        return static_scaled_fp8_quant(activated, out_scale, quant_dtype)
    num_tokens, out_features = gate_up.shape[0], gate_up.shape[1] // 2
    dtype = KERNEL_FP8_DTYPE if out_scale is not None else gate_up.dtype
    out = torch.empty((num_tokens, out_features), dtype=dtype, device=gate_up.device)
    if num_tokens == 0:
        return out
    block = 1024
    launch(
        _silu_and_mul_kernel,
        (num_tokens, triton.cdiv(out_features, block)),
        gate_up,
        out,
        out_scale if out_scale is not None else gate_up,
        out_features,
        gate_up.stride(0),
        out.stride(0),
        BLOCK=block,
        QUANT_OUT=out_scale is not None,
    )
    return out


def silu_and_mul_2d(x: torch.Tensor) -> torch.Tensor:
    """``silu_and_mul(x)`` for ``x (T, 2d)``: the kernel where it runs, else torch: (T, d)."""
    return silu_and_mul_epilogue(x, None)


def silu_and_mul_2d_fake(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty((x.shape[0], x.shape[1] // 2))


def silu_and_mul_op() -> Any:
    """``torch.ops.pieceworks.silu_and_mul``, registered on first use (never at import)."""
    return direct_register_custom_op(
        "silu_and_mul", silu_and_mul_2d, mutates_args=[], fake_impl=silu_and_mul_2d_fake
    )
