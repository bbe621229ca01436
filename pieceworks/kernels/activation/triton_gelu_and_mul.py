"""``pieceworks::gelu_and_mul``: Gemma's GeGLU, ``gelu(gate) * up``, as one Triton launch.

Algorithm: one program per (token, block of ``BLOCK`` output columns); it loads the gate and up
halves of the token's row, computes in float32 ``gelu(gate) * up`` (the erf form, or the tanh
approximation ``0.5 * g * (1 + tanh(sqrt(2 / pi) * (g + 0.044715 * g**3)))``, torch's
``approximate="tanh"``, with ``tanh(y) = 1 - 2 / (exp(2y) + 1)`` on ``y`` clamped to
``[-10, 10]``, where float32's tanh is already +-1, so that ``exp`` never overflows) and
stores the result in the input's dtype, rounded once. The activation is the jitted ``gelu``,
which the decode GEMV's gated epilogue calls too (``pieceworks::small_m_gelu_and_mul_linear``,
``kernels/gemv/triton_gemv.py``).
Operands: ``gate_up (T, 2d)`` with unit column stride, gate in columns ``[0, d)`` and up in
``[d, 2d)``; the output ``(T, d)`` is a new contiguous tensor. Invariants: nothing outside a row's
``2d`` columns is read; ``T = 0`` launches nothing.

``gelu_and_mul_op()`` registers the op (with its fake) on first use: what ``GeluAndMul``
(``models/layers/activation.py``) calls where the chooser gives ``gelu_and_mul`` this kernel.
Inside the op, where the kernel does not run (``triton_device.kernel_runs_on``: a CPU tensor, a
strided input), the torch form (``torch_activation.gelu_and_mul``) computes it.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import triton
import triton.language as tl

from pieceworks.core.custom_op import direct_register_custom_op
from pieceworks.kernels import triton_device
from pieceworks.kernels.activation.torch_activation import GELU_APPROXIMATIONS, gelu_and_mul
from pieceworks.kernels.triton_launch import launch

_SQRT_2_OVER_PI = tl.constexpr(math.sqrt(2.0 / math.pi))
_SQRT_HALF = tl.constexpr(math.sqrt(0.5))


@triton.jit
def gelu(gate, TANH: tl.constexpr):
    """``gelu(gate)`` of a float32 block: the tanh approximation where ``TANH``, else the erf
    form; shared with the gate/up GEMV's epilogue (``kernels/gemv/triton_gemv_kernel.py``), so
    the fused and the unfused GeGLU compute the same float32 values."""
    if TANH:
        inner = _SQRT_2_OVER_PI * (gate + 0.044715 * gate * gate * gate)
        inner = tl.minimum(tl.maximum(inner, -10.0), 10.0)  # tanh(10) is 1.0 in float32
        tanh = 1.0 - 2.0 / (tl.exp(2.0 * inner) + 1.0)
        activated = 0.5 * gate * (1.0 + tanh)
    else:
        activated = 0.5 * gate * (1.0 + tl.math.erf(gate * _SQRT_HALF))
    return activated


@triton.jit
def _gelu_and_mul_kernel(
    gate_up_ptr,
    out_ptr,
    out_features,
    stride_in,
    stride_out,
    BLOCK: tl.constexpr,
    TANH: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    columns = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = columns < out_features
    row = gate_up_ptr + token * stride_in
    gate = tl.load(row + columns, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(row + out_features + columns, mask=mask, other=0.0).to(tl.float32)
    result = gelu(gate, TANH) * up
    tl.store(out_ptr + token * stride_out + columns, result.to(out_ptr.dtype.element_ty), mask=mask)


def gelu_and_mul_2d(x: torch.Tensor, approximate: str) -> torch.Tensor:
    """``gelu_and_mul(x, approximate)`` for ``x (T, 2d)``: the kernel where it runs, else torch:
    ``(T, d)``."""
    if approximate not in GELU_APPROXIMATIONS:
        raise ValueError(f"gelu approximate={approximate!r}; supported: {GELU_APPROXIMATIONS}")
    if not triton_device.kernel_runs_on(x) or x.stride(1) != 1:
        return gelu_and_mul(x, approximate)
    num_tokens, out_features = x.shape[0], x.shape[1] // 2
    out = torch.empty((num_tokens, out_features), dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out
    block = 1024
    launch(
        _gelu_and_mul_kernel,
        (num_tokens, triton.cdiv(out_features, block)),
        x,
        out,
        out_features,
        x.stride(0),
        out.stride(0),
        BLOCK=block,
        TANH=approximate == "tanh",
    )
    return out


def gelu_and_mul_2d_fake(x: torch.Tensor, approximate: str) -> torch.Tensor:
    return x.new_empty((x.shape[0], x.shape[1] // 2))


def gelu_and_mul_op() -> Any:
    """``torch.ops.pieceworks.gelu_and_mul``, registered on first use (never at import)."""
    return direct_register_custom_op(
        "gelu_and_mul", gelu_and_mul_2d, mutates_args=[], fake_impl=gelu_and_mul_2d_fake
    )
