"""RMSNorm (+ residual add) -> static FP8 quant fusion: matched, replaced, same bytes out.

The functions the layers call (``core.norm_quant``) are traced with a symbolic token count
(``graph_backend``); the pass manager with fusion on must replace each norm + quant pair by one
fused op called in place (fix-functionalization runs last), leave no unfused quant behind, and
produce the same FP8 bytes as eager (the fused ops' CPU implementation is the torch reference).
A reshape between norm and quant hides the pattern unless no-op elimination runs first; a
per-token scale is not a static per-tensor quant and must not match. Each test traces the
patterns afresh (the pass keeps them per process).
Run: pytest tests/core/passes/test_fusion.py
"""

from __future__ import annotations

import pytest
import torch

from pieceworks.core.config import PassConfig
from pieceworks.core.norm_quant import add_rms_norm, fp8_dtype, rms_norm, static_scaled_fp8_quant
from pieceworks.core.passes import fusion
from pieceworks.core.passes.fusion import RMSNormQuantFusionPass
from pieceworks.core.passes.pass_manager import PostGradPassManager
from pieceworks.kernels.norm_quant.norm_quant_ops import register_norm_quant_ops
from tests.core.passes.graph_backend import run_with_passes

FUSED = "pieceworks.rms_norm_static_fp8_quant.default"
FUSED_ADD = "pieceworks.fused_add_rms_norm_static_fp8_quant.default"
TO_FP8 = "prims.convert_element_type.default"  # the quant's final cast (also other casts)
EPS = 1e-5
# The platform's FP8 format, read here rather than inside the traced functions: the traced code
# then holds only the quant itself (a platform lookup traced by Dynamo is not what is tested).
FP8_DTYPE = fp8_dtype()


@pytest.fixture(autouse=True)
def _fused_ops(monkeypatch):
    register_norm_quant_ops()
    # The pass keeps the patterns it traced for the process: each test traces them afresh, so
    # what it matches runs replacement code that its own call built (and a mutation tool that
    # maps code to the tests running it sees every test of the patterns, not only the first).
    monkeypatch.setattr(fusion, "_patterns", None)


def manager(enable_noop: bool = True) -> PostGradPassManager:
    return PostGradPassManager(PassConfig(enable_noop=enable_noop, enable_fusion=True))


def inputs(dtype: torch.dtype, num_tokens: int = 5, hidden: int = 64):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(num_tokens, hidden, generator=generator).to(dtype)
    residual = torch.randn(num_tokens, hidden, generator=generator).to(dtype)
    weight = (1 + 0.1 * torch.randn(hidden, generator=generator)).to(dtype)
    return x, residual, weight, torch.tensor(0.02)


def norm_then_quant(x, weight, scale):
    return static_scaled_fp8_quant(rms_norm(x, weight, EPS), scale, FP8_DTYPE)


def add_norm_then_quant(x, residual, weight, scale):
    normed, residual = add_rms_norm(x, residual, weight, EPS)
    return static_scaled_fp8_quant(normed, scale, FP8_DTYPE), residual


def assert_same_bytes(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype
    assert torch.equal(actual.view(torch.uint8), expected.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rms_norm_then_quant_becomes_the_fused_op(dtype):
    x, _, weight, scale = inputs(dtype)
    out, run = run_with_passes(norm_then_quant, [x, weight, scale], [manager()])
    assert (run.before[FUSED], run.after[FUSED]) == (0, 1)
    assert run.after["aten.rsqrt.default"] == 0 and run.after["auto_functionalized"] == 0
    assert_same_bytes(out, norm_then_quant(x, weight, scale))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_residual_add_form_becomes_the_fused_add_op(dtype):
    x, residual, weight, scale = inputs(dtype)
    (quantized, new_residual), run = run_with_passes(
        add_norm_then_quant, [x, residual, weight, scale], [manager()]
    )
    # One match of the residual form: the add is inside it, not left behind for the plain form.
    assert (run.after[FUSED_ADD], run.after[FUSED], run.after["aten.add.Tensor"]) == (1, 0, 0)
    expected_quantized, expected_residual = add_norm_then_quant(x, residual, weight, scale)
    assert_same_bytes(quantized, expected_quantized)
    torch.testing.assert_close(new_residual, expected_residual, rtol=0, atol=0)


def decoder_like(x, residual, w1, w2, scale):
    """Two norm + quant sites (as a layer's two norms), the second behind an FP8-linear reshape."""
    first = static_scaled_fp8_quant(rms_norm(x, w1, EPS), scale, FP8_DTYPE)
    hidden = first.to(x.dtype) + x
    normed, residual = add_rms_norm(hidden, residual, w2, EPS)
    second = static_scaled_fp8_quant(normed.reshape(-1, normed.shape[-1]), scale, FP8_DTYPE)
    return first, second, residual


def test_reshape_between_norm_and_quant_needs_noop_elimination():
    x, residual, weight, scale = inputs(torch.bfloat16)
    args = [x, residual, weight, weight * 0.5, scale]
    _, without_noop = run_with_passes(decoder_like, args, [manager(enable_noop=False)])
    assert (without_noop.after[FUSED], without_noop.after[FUSED_ADD]) == (1, 0)
    out, with_noop = run_with_passes(decoder_like, args, [manager(enable_noop=True)])
    assert (with_noop.after[FUSED], with_noop.after[FUSED_ADD]) == (1, 1)
    for actual, expected in zip(out, decoder_like(*args)):
        assert_same_bytes(actual, expected)


def test_per_token_scale_is_not_fused():
    x, _, weight, _ = inputs(torch.float32)
    per_token_scale = torch.full((x.shape[0], 1), 0.02)
    fusion = RMSNormQuantFusionPass()
    _, run = run_with_passes(norm_then_quant, [x, weight, per_token_scale], [fusion])
    assert fusion.num_rewrites == 0 and run.after[FUSED] == 0
