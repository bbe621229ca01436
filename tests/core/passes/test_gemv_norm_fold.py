"""The fused add + RMSNorm + FP8 quant folded into the small-M FP8 GEMV that reads it.

Traced with a symbolic token count (``graph_backend``), the pass manager with fusion on must turn
"add_rms_norm -> quant -> one of the three small-M FP8 GEMV ops" into one call of the folded op,
with no fused norm op, no GEMV op and no functionalized node left, and the same output bytes and
residual sum as eager (on CPU every op runs its torch path). Folding must not happen where it
would change what is computed: a second reader of the quantized values, a GEMV quantizing with
another scale, or ``fold_norm_into_gemv=False``.
Run: pytest tests/core/passes/test_gemv_norm_fold.py
"""

from __future__ import annotations

import pytest
import torch

from pieceworks.core.config import PassConfig
from pieceworks.core.norm_quant import add_rms_norm, static_scaled_fp8_quant
from pieceworks.core.passes.pass_manager import PostGradPassManager
from pieceworks.models.layers.quantization.fp8 import (
    quantize_weight_per_tensor,
    register_small_m_fp8_ops,
    small_m_fp8_rope_linear_op,
)
from pieceworks.models.layers.quantization.fp8_norm_linear import (
    small_m_fp8_add_rms_norm_linear_op,
)
from pieceworks.models.layers.quantization.norm_quant_ops import register_norm_quant_ops
from tests.core.passes.graph_backend import run_with_passes

FOLDED = "pieceworks.small_m_fp8_add_rms_norm_linear.default"
FUSED_ADD = "pieceworks.fused_add_rms_norm_static_fp8_quant.default"
GEMV_OPS = (
    "pieceworks.small_m_fp8_linear.default",
    "pieceworks.small_m_fp8_silu_and_mul.default",
    "pieceworks.small_m_fp8_rope_linear.default",
)
EPS = 1e-5
HIDDEN, HEAD_SIZE = 64, 16
DTYPE = torch.bfloat16


@pytest.fixture(autouse=True)
def _ops():
    register_norm_quant_ops()
    register_small_m_fp8_ops()
    small_m_fp8_rope_linear_op()
    small_m_fp8_add_rms_norm_linear_op()


def manager(fold: bool = True) -> PostGradPassManager:
    return PostGradPassManager(PassConfig(enable_fusion=True, fold_norm_into_gemv=fold))


def operands(out_rows: int):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(5, HIDDEN, generator=generator).to(DTYPE)
    residual = torch.randn(5, HIDDEN, generator=generator).to(DTYPE)
    norm_weight = (1 + 0.1 * torch.randn(HIDDEN, generator=generator)).to(DTYPE)
    weight, weight_scale = quantize_weight_per_tensor(
        (torch.randn(out_rows, HIDDEN, generator=generator) / 8).to(DTYPE)
    )
    return x, residual, norm_weight, torch.tensor(0.02), weight, weight_scale


def norm_then(gemv):
    """add_rms_norm -> quant -> ``gemv(x_fp8, scale, weight, weight_scale)``, as a layer does."""

    def fn(x, residual, norm_weight, scale, weight, weight_scale, *extra):
        normed, residual_out = add_rms_norm(x, residual, norm_weight, EPS)
        x_fp8 = static_scaled_fp8_quant(normed, scale)
        return gemv(x_fp8, weight, scale, weight_scale, *extra), residual_out

    return fn


def linear(x_fp8, weight, scale, weight_scale):
    return torch.ops.pieceworks.small_m_fp8_linear(
        x_fp8, weight, scale, weight_scale, None, DTYPE, False
    )


def silu_and_mul(x_fp8, weight, scale, weight_scale, out_scale):
    return torch.ops.pieceworks.small_m_fp8_silu_and_mul(
        x_fp8, weight, scale, weight_scale, out_scale, DTYPE, False
    )


def rope(x_fp8, weight, scale, weight_scale, positions, cos_sin_cache):
    return torch.ops.pieceworks.small_m_fp8_rope_linear(
        x_fp8, weight, scale, weight_scale, positions, cos_sin_cache, HEAD_SIZE, 2, DTYPE, False
    )


def case(name: str):
    """(function, arguments) of one GEMV kind: 3 heads of HEAD_SIZE for rope (2 rotated)."""
    if name == "linear":
        return norm_then(linear), list(operands(48))
    if name == "silu_and_mul":
        return norm_then(silu_and_mul), [*operands(96), torch.tensor(0.05)]
    positions = torch.tensor([3, 0, 7, 1, 2])
    angles = torch.arange(16)[:, None] * torch.linspace(0.1, 1.0, HEAD_SIZE // 2)[None, :]
    cos_sin_cache = torch.cat([angles.cos(), angles.sin()], dim=1).to(DTYPE)
    return norm_then(rope), [*operands(3 * HEAD_SIZE), positions, cos_sin_cache]


def assert_same(actual, expected) -> None:
    for got, want in zip(actual, expected, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("name", ["linear", "silu_and_mul", "rope"])
def test_norm_and_gemv_become_one_op(name):
    fn, args = case(name)
    out, run = run_with_passes(fn, args, [manager()])
    assert run.after[FOLDED] == 1
    assert run.after[FUSED_ADD] == 0 and run.after["auto_functionalized"] == 0
    assert all(run.after[op] == 0 for op in GEMV_OPS)
    assert run.after["aten.rsqrt.default"] == 0  # the norm's arithmetic is inside the op
    assert_same(out, fn(*args))


def test_no_fold_when_switched_off():
    fn, args = case("silu_and_mul")
    out, run = run_with_passes(fn, args, [manager(fold=False)])
    assert (run.after[FOLDED], run.after[FUSED_ADD]) == (0, 1)
    assert_same(out, fn(*args))


def test_no_fold_when_the_quantized_input_has_another_reader():
    def fn(x, residual, norm_weight, scale, weight, weight_scale):
        normed, residual_out = add_rms_norm(x, residual, norm_weight, EPS)
        x_fp8 = static_scaled_fp8_quant(normed, scale)
        return linear(x_fp8, weight, scale, weight_scale), residual_out, x_fp8.to(DTYPE)

    args = list(operands(48))
    out, run = run_with_passes(fn, args, [manager()])
    assert (run.after[FOLDED], run.after[FUSED_ADD]) == (0, 1)
    assert_same(out, fn(*args))


def test_no_fold_when_the_gemv_uses_another_scale():
    def fn(x, residual, norm_weight, scale, weight, weight_scale, other_scale):
        normed, residual_out = add_rms_norm(x, residual, norm_weight, EPS)
        x_fp8 = static_scaled_fp8_quant(normed, scale)
        return linear(x_fp8, weight, other_scale, weight_scale), residual_out

    args = [*operands(48), torch.tensor(0.03)]
    out, run = run_with_passes(fn, args, [manager()])
    assert (run.after[FOLDED], run.after[FUSED_ADD]) == (0, 1)
    assert_same(out, fn(*args))
