"""The decode GEMV ops with the RMSNorm before them as the GEMV's prologue.

Why: in a compiled decode graph every ``input_layernorm -> qkv_proj`` and
``post_attention_layernorm -> gate_up_proj`` is two kernels: Inductor's ``add + rms_norm``
reduction, which writes the normalised activations and the new residual, then the GEMV, which
reads them back. For a small model (SmolLM2-135M: hidden 576) the norm kernel costs about as much
as the GEMV. The GEMV's ``NORM`` prologue (``triton_gemv_kernel.py``) computes each token's rstd
from ``h = x (+ residual)`` in one pass over K and feeds the product the normalised chunks; program
0 stores ``h`` as the new residual: one launch per pair instead of two.

The ops: each is the norm (``core.norm_quant.rms_norm``, or ``add_rms_norm`` where ``residual`` is
given) followed by one GEMV op, with that op's arguments after its x:

    small_m_rms_norm_linear(x, residual, w, eps, W, bias)     -> small_m_linear(n, W, bias)
    small_m_rms_norm_silu_and_mul_linear(x, residual, w, eps, W)
                                                              -> small_m_silu_and_mul_linear(n, W)
    small_m_rms_norm_rope_linear(x, residual, w, eps, W, p, cache, D, H)
                                                              -> small_m_rope_linear(n, W, ...)
    small_m_rms_norm_qk_norm_rope_linear(x, residual, w, eps, W, p, cache, D, Hq, Hkv, ...)
                                                              -> small_m_qk_norm_rope_linear(...)

each returning ``(result, residual_out)``: ``residual_out`` is ``x + residual`` rounded to x's
dtype (the residual stream ``add_rms_norm`` returns), or an empty ``(0, K)`` tensor without a
residual. The kernel runs where its GEMV would (``uses_kernel``, ``uses_rope_kernel``) and the
norm's operands fit (``takes_norm``: x's dtype, rows contiguous along K); elsewhere the op runs the
norm (``rms_norm_first``: one Triton launch where the kernels run, the torch forms elsewhere) and
then the unfused GEMV op, which computes what the graph it replaced did. The qk form runs its GEMV
with the prologue and then the in-place head norm and rotary (``triton_gemv_qk_norm_rope.py``).
The rounding is the torch forms': the sum in float32, normalised unrounded, ``h * rstd`` rounded
to the dtype, then the weight multiplied in the dtype (rounded again); only the order of the sum
of squares differs from torch's (``tests/kernels/test_gemv_norm.py``). The norm-GEMV fusion pass
(``core/passes/norm_gemv_fusion.py``) puts these ops into compiled graphs;
``quantization/base.py`` registers them with the other GEMV ops.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from pieceworks.core.custom_op import direct_register_custom_op
from pieceworks.core.norm_quant import add_rms_norm, rms_norm
from pieceworks.kernels import triton_device
from pieceworks.kernels.gemv.triton_gemv import (
    NormPrologue,
    launch_gemv,
    small_m_linear,
    small_m_silu_and_mul_linear,
    uses_kernel,
)
from pieceworks.kernels.gemv.triton_gemv_rope import (
    rope_epilogue,
    small_m_rope_linear,
    uses_rope_kernel,
)
from pieceworks.kernels.norm_quant.triton_norm_quant import rms_norm_rows
from pieceworks.kernels.rope.triton_qk_norm_rope import norm_rotate_qk_heads


def takes_norm(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor) -> bool:
    """Whether the GEMV's norm prologue takes these operands (the GEMV's own: ``uses_kernel``)."""
    return (
        norm_weight.dtype == x.dtype
        and norm_weight.shape == (x.shape[1],)
        and norm_weight.is_contiguous()
        and (
            residual is None
            or (residual.dtype == x.dtype and residual.shape == x.shape and residual.stride(1) == 1)
        )
    )


def no_residual(x: torch.Tensor) -> torch.Tensor:
    """The ops' ``residual_out`` where they were given no residual: empty, (0, K)."""
    return x.new_empty((0, x.shape[1]))


def norm_prologue(
    x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, epsilon: float
) -> tuple[NormPrologue, torch.Tensor]:
    """The prologue's operands and the ``residual_out`` the kernel writes (a fresh tensor)."""
    if residual is None:
        return NormPrologue(norm_weight, epsilon), no_residual(x)
    residual_out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    return NormPrologue(norm_weight, epsilon, residual, residual_out), residual_out


def rms_norm_first(
    x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, epsilon: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(h), h)``, ``h = x (+ residual)``, for the unfused GEMV op: one Triton launch
    where the kernels run on contiguous rows (as eager torch ops the norm would be about ten
    launches, which Inductor can no longer fuse inside the op), else the torch forms."""
    operands = [x, norm_weight] + ([residual] if residual is not None else [])
    if triton_device.kernel_runs_on(x) and all(
        t.is_contiguous() and t.dtype == x.dtype for t in operands
    ):
        normed, residual_out = rms_norm_rows(x, residual, norm_weight, epsilon)
        return normed, residual_out if residual_out is not None else no_residual(x)
    if residual is None:
        return rms_norm(x, norm_weight, epsilon), no_residual(x)
    return add_rms_norm(x, residual, norm_weight, epsilon)


def small_m_rms_norm_linear(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    epsilon: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(small_m_linear(rms_norm(h), weight, bias), h)``, ``h = x (+ residual)``: (T, N) and
    (T, K), the latter empty without a residual."""
    if not (uses_kernel(x, weight) and takes_norm(x, residual, norm_weight)):
        normed, residual_out = rms_norm_first(x, residual, norm_weight, epsilon)
        return small_m_linear(normed, weight, bias), residual_out
    norm, residual_out = norm_prologue(x, residual, norm_weight, epsilon)
    out = launch_gemv(x, weight, norm=norm)  # (T, N)
    return out if bias is None else out + bias, residual_out


def small_m_rms_norm_silu_and_mul_linear(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    epsilon: float,
    weight: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(small_m_silu_and_mul_linear(rms_norm(h), weight), h)``: (T, N), (T, K)."""
    if not (uses_kernel(x, weight) and takes_norm(x, residual, norm_weight)):
        normed, residual_out = rms_norm_first(x, residual, norm_weight, epsilon)
        return small_m_silu_and_mul_linear(normed, weight), residual_out
    norm, residual_out = norm_prologue(x, residual, norm_weight, epsilon)
    return launch_gemv(x, weight, gated=True, norm=norm), residual_out


def small_m_rms_norm_rope_linear(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    epsilon: float,
    weight: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    head_size: int,
    num_rotary_heads: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(small_m_rope_linear(rms_norm(h), weight, ...), h)``: (T, (Hq + 2 Hkv) D), (T, K)."""
    rope_args = (positions, cos_sin_cache, head_size, num_rotary_heads)
    fits = uses_rope_kernel(x, weight, cos_sin_cache, head_size, x.dtype)
    if not (fits and takes_norm(x, residual, norm_weight)):
        normed, residual_out = rms_norm_first(x, residual, norm_weight, epsilon)
        return small_m_rope_linear(normed, weight, *rope_args), residual_out
    norm, residual_out = norm_prologue(x, residual, norm_weight, epsilon)
    return launch_gemv(x, weight, rope=rope_epilogue(*rope_args), norm=norm), residual_out


def small_m_rms_norm_qk_norm_rope_linear(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    epsilon: float,
    weight: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    head_size: int,
    num_q_heads: int,
    num_kv_heads: int,
    q_norm_weight: torch.Tensor,
    k_norm_weight: torch.Tensor,
    head_epsilon: float,
    unit_offset: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(small_m_qk_norm_rope_linear(rms_norm(h), weight, ...), h)``: the GEMV with the norm
    prologue, then the q and k heads normalised and rotated in place; (T, (Hq + 2 Hkv) D), (T, K).
    """
    qkv, residual_out = small_m_rms_norm_linear(x, residual, norm_weight, epsilon, weight)
    heads = (head_size, num_q_heads, num_kv_heads)
    head_norm = (q_norm_weight, k_norm_weight, head_epsilon, unit_offset)
    return norm_rotate_qk_heads(positions, qkv, cos_sin_cache, *heads, head_norm), residual_out


def _outputs(
    x: torch.Tensor, residual: torch.Tensor | None, num_columns: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """The fake ops' ``(result (T, num_columns), residual_out)``."""
    residual_out = x.new_empty(x.shape) if residual is not None else no_residual(x)
    return x.new_empty((x.shape[0], num_columns)), residual_out


def small_m_rms_norm_linear_fake(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    epsilon: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _outputs(x, residual, weight.shape[0])


def small_m_rms_norm_silu_and_mul_linear_fake(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    epsilon: float,
    weight: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _outputs(x, residual, weight.shape[0] // 2)


def small_m_rms_norm_rope_linear_fake(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    epsilon: float,
    weight: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    head_size: int,
    num_rotary_heads: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _outputs(x, residual, weight.shape[0])


def small_m_rms_norm_qk_norm_rope_linear_fake(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    epsilon: float,
    weight: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    head_size: int,
    num_q_heads: int,
    num_kv_heads: int,
    q_norm_weight: torch.Tensor,
    k_norm_weight: torch.Tensor,
    head_epsilon: float,
    unit_offset: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _outputs(x, residual, weight.shape[0])


# op name -> (implementation, fake)
NORM_GEMV_OPS: dict[str, tuple[Callable[..., Any], Callable[..., Any]]] = {
    "small_m_rms_norm_linear": (small_m_rms_norm_linear, small_m_rms_norm_linear_fake),
    "small_m_rms_norm_silu_and_mul_linear": (
        small_m_rms_norm_silu_and_mul_linear,
        small_m_rms_norm_silu_and_mul_linear_fake,
    ),
    "small_m_rms_norm_rope_linear": (
        small_m_rms_norm_rope_linear,
        small_m_rms_norm_rope_linear_fake,
    ),
    "small_m_rms_norm_qk_norm_rope_linear": (
        small_m_rms_norm_qk_norm_rope_linear,
        small_m_rms_norm_qk_norm_rope_linear_fake,
    ),
}


def register_norm_gemv_ops() -> None:
    """Register the four ops as ``torch.ops.pieceworks.<name>`` (idempotent; on first use, never
    at import: registering resolves the platform's dispatch key)."""
    for name, (implementation, fake) in NORM_GEMV_OPS.items():
        direct_register_custom_op(name, implementation, mutates_args=[], fake_impl=fake)
