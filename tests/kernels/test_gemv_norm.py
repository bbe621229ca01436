"""The GEMV's RMSNorm prologue and the norm-GEMV ops (``triton_gemv_norm.py``).

Proves that (1) the GEMV with the ``norm`` prologue, plain, gated (SiLU) and rotary, with and
without a residual, float32 and bfloat16, 1 and 5 tokens, K off the chunk grid (4 chunks of 64,
the last partial), computes its product of what ``core.norm_quant.rms_norm`` / ``add_rms_norm``
make: it is as close to the float64 product of their output as the plain GEMV is, in bfloat16
equals the plain GEMV run on their output bit for bit on at least 90 % of the values (the rest:
the float32 sum of squares, summed in another order, moved a rounding of the normalised input; in
float32 no rounding hides that last bit of rstd, so only the tolerance holds), and writes
``add_rms_norm``'s residual bit for bit; it reads nothing past K of x or the residual, and FP8
operands, a norm weight of another shape or a residual without ``residual_out`` are refused with
a ValueError; (2) the norm alone (``rms_norm_rows``, the ops' norm past the GEMV's token limit)
writes the same residual and, in bfloat16, the same normalised bytes on 99 % of the values; (3)
each op launches the GEMV once with the prologue up to ``max_gemv_tokens`` where the kernels run,
and past it runs the norm kernel and then the unfused op; on CPU tensors it is bit for bit the
torch forms the graph it replaces runs; (4) the ops have fakes and trace under
``torch.compile(fullgraph=True)`` with a dynamic token count.

What runs where: as ``test_triton_gemv.py`` (its operands and tolerances are reused): without a
GPU the kernels run in Triton's interpreter on CPU tensors, the CPU declared a kernel device where
a test needs the op to launch them. The GPU check at a real size: ``test_gemv_norm_gpu.py``.
Run: TRITON_INTERPRET=1 python -m pytest -q tests/kernels/test_gemv_norm.py
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels below are decorated

from pieceworks.core.norm_quant import KERNEL_FP8_DTYPE, add_rms_norm, rms_norm  # noqa: E402
from pieceworks.kernels import triton_device  # noqa: E402
from pieceworks.kernels.gemv import triton_gemv_norm  # noqa: E402
from pieceworks.kernels.gemv.triton_gemv import (  # noqa: E402
    GemvConfig,
    NormPrologue,
    RopeEpilogue,
    launch_gemv,
    small_m_linear,
    small_m_silu_and_mul_linear,
)
from pieceworks.kernels.gemv.triton_gemv_norm import (  # noqa: E402
    register_norm_gemv_ops,
    small_m_rms_norm_linear,
    small_m_rms_norm_qk_norm_rope_linear,
    small_m_rms_norm_rope_linear,
    small_m_rms_norm_silu_and_mul_linear,
)
from pieceworks.kernels.gemv.triton_gemv_qk_norm_rope import (  # noqa: E402
    small_m_qk_norm_rope_linear,
)
from pieceworks.kernels.gemv.triton_gemv_rope import small_m_rope_linear  # noqa: E402
from pieceworks.kernels.norm_quant.triton_norm_quant import rms_norm_rows  # noqa: E402
from pieceworks.models.layers.activation import silu_and_mul  # noqa: E402
from tests.kernels.test_gemv_rope import check_rope_kernel, rope_operands  # noqa: E402
from tests.kernels.test_triton_gemv import (  # noqa: E402
    DEVICE,
    TOLERANCES,
    operands,
    requires_triton,
)

EPS = 1e-6
HIDDEN = 200  # K: 4 chunks of 64, the last partial
CONFIG = GemvConfig(block_n=16, block_k=64)
NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE = 4, 2, 32  # the rotary form's qkv weight: 8 heads of 32


def norm_operands(num_tokens: int, dtype: torch.dtype, seed: int = 0):
    """``(x, residual, norm_weight)``: activations of a few units, a weight near 1."""
    generator = torch.Generator().manual_seed(seed + num_tokens)
    x, residual = (3 * torch.randn(num_tokens, HIDDEN, generator=generator) for _ in range(2))
    norm_weight = 1 + 0.3 * torch.randn(HIDDEN, generator=generator)
    return x.to(DEVICE, dtype), residual.to(DEVICE, dtype), norm_weight.to(DEVICE, dtype)


def torch_norm(x, residual, norm_weight):
    """What the layers compute: ``(rms_norm(h), h)`` by the torch forms (h None without one)."""
    if residual is None:
        return rms_norm(x, norm_weight, EPS), None
    return add_rms_norm(x, residual, norm_weight, EPS)


def epilogue_operands(epilogue: str, num_tokens: int, dtype: torch.dtype):
    """``(weight, launch keyword arguments, rotary embedding or None)`` of the GEMV
    ``epilogue``."""
    if epilogue == "rope":
        rows, num_rotary_heads = (
            (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_SIZE,
            NUM_HEADS + NUM_KV_HEADS,
        )
        rotary_emb, positions = rope_operands(num_tokens, HEAD_SIZE, dtype)
        rope = RopeEpilogue(positions, rotary_emb.cos_sin_cache, HEAD_SIZE, num_rotary_heads)
        return operands(num_tokens, rows, HIDDEN, dtype)[1], {"rope": rope}, rotary_emb
    _, weight = operands(num_tokens, 2 * 40 if epilogue == "gated" else 40, HIDDEN, dtype)
    return weight, {"gated": epilogue == "gated"}, None


def check_against_float64(output, normed, weight, kwargs, rotary_emb):
    """``output`` against the float64 product of the torch norm's output, epilogue applied."""
    dtype = output.dtype
    product = normed.double() @ weight.double().t()
    if rotary_emb is not None:
        positions = kwargs["rope"].positions
        check_rope_kernel(output, product.to(dtype), positions, rotary_emb, NUM_HEADS, NUM_KV_HEADS)
        return
    expected = silu_and_mul(product.to(dtype).double()) if kwargs["gated"] else product
    torch.testing.assert_close(output.double(), expected, **TOLERANCES[dtype])


@requires_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 5])
@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("epilogue", ["plain", "gated", "rope"])
def test_the_prologue_feeds_the_product_what_the_torch_norm_makes(
    dtype, num_tokens, with_residual, epilogue
):
    x, residual, norm_weight = norm_operands(num_tokens, dtype)
    residual = residual if with_residual else None
    weight, kwargs, rotary_emb = epilogue_operands(epilogue, num_tokens, dtype)
    residual_out = torch.empty_like(x) if with_residual else None
    norm = NormPrologue(norm_weight, EPS, residual, residual_out)
    output = launch_gemv(x, weight, CONFIG, norm=norm, **kwargs)
    normed, new_residual = torch_norm(x, residual, norm_weight)
    if with_residual:
        assert torch.equal(residual_out, new_residual)  # the float32 sum, rounded once
    check_against_float64(output, normed, weight, kwargs, rotary_emb)
    unfused = launch_gemv(normed, weight, CONFIG, **kwargs)  # the GEMV after the norm
    if dtype == torch.bfloat16:  # (float32: no rounding hides the last bit of rstd)
        assert (output == unfused).double().mean() >= 0.9
    torch.testing.assert_close(output, unfused, **TOLERANCES[dtype])


@requires_triton
def test_the_prologue_reads_nothing_past_k():
    """x and the residual as the first K columns of NaN-padded rows: an unmasked read poisons
    the sum of squares, and so every value."""
    num_tokens, dtype = 3, torch.bfloat16
    x, residual, norm_weight = norm_operands(num_tokens, dtype)
    padded = torch.full((2, num_tokens, HIDDEN + 8), float("nan"), dtype=dtype, device=DEVICE)
    padded[0, :, :HIDDEN], padded[1, :, :HIDDEN] = x, residual
    weight, _, _ = epilogue_operands("plain", num_tokens, dtype)
    residual_out = torch.empty_like(x)
    norm = NormPrologue(norm_weight, EPS, padded[1, :, :HIDDEN], residual_out)
    output = launch_gemv(padded[0, :, :HIDDEN], weight, CONFIG, norm=norm)
    normed, new_residual = torch_norm(x, residual, norm_weight)
    assert torch.equal(residual_out, new_residual)
    torch.testing.assert_close(output, launch_gemv(normed, weight, CONFIG), **TOLERANCES[dtype])


def test_the_launch_refuses_what_the_prologue_cannot_take():
    x, residual, norm_weight = norm_operands(2, torch.float32)
    weight, _, _ = epilogue_operands("plain", 2, torch.float32)
    scale = torch.tensor(1.0)
    fp8 = (x.to(KERNEL_FP8_DTYPE), weight.to(KERNEL_FP8_DTYPE))
    with pytest.raises(ValueError, match="not FP8 operands"):
        launch_gemv(*fp8, scales=(scale, scale), out_dtype=x.dtype, norm=NormPrologue(x[0], EPS))
    with pytest.raises(ValueError, match=f"norm weight of \\({HIDDEN},\\)"):
        launch_gemv(x, weight, norm=NormPrologue(norm_weight[:-1], EPS))
    with pytest.raises(ValueError, match="contiguous residual_out"):
        launch_gemv(x, weight, norm=NormPrologue(norm_weight, EPS, residual))


@requires_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_norm_alone_computes_the_torch_norm(dtype):
    x, residual, norm_weight = norm_operands(5, dtype)
    normed, residual_out = rms_norm_rows(x, residual, norm_weight, EPS)
    expected, new_residual = add_rms_norm(x, residual, norm_weight, EPS)
    assert torch.equal(residual_out, new_residual)
    if dtype == torch.bfloat16:  # the same bytes, where the sum of squares' order hides
        assert (normed == expected).double().mean() >= 0.99
    torch.testing.assert_close(normed, expected, **TOLERANCES[dtype])
    normed, none = rms_norm_rows(x, None, norm_weight, EPS)
    assert none is None
    torch.testing.assert_close(normed, rms_norm(x, norm_weight, EPS), **TOLERANCES[dtype])


# -- the ops ---------------------------------------------------------------------------------------


def op_cases(num_tokens: int, dtype: torch.dtype):
    """``(fused op, its arguments after the norm's, the unfused op)`` of each GEMV form."""
    rope_weight, kwargs, _ = epilogue_operands("rope", num_tokens, dtype)
    rope = kwargs["rope"]
    rope_args = (rope.positions, rope.cos_sin_cache, HEAD_SIZE)
    gated_weight, _, _ = epilogue_operands("gated", num_tokens, dtype)
    weight, _, _ = epilogue_operands("plain", num_tokens, dtype)
    head_norm = (norm_operands(1, dtype)[2][:HEAD_SIZE], weight[0, :HEAD_SIZE], 1e-5, False)
    qk_args = (rope_weight, *rope_args, NUM_HEADS, NUM_KV_HEADS, *head_norm)
    return [
        (small_m_rms_norm_linear, (weight, None), small_m_linear),
        (small_m_rms_norm_silu_and_mul_linear, (gated_weight,), small_m_silu_and_mul_linear),
        (
            small_m_rms_norm_rope_linear,
            (rope_weight, *rope_args, NUM_HEADS + NUM_KV_HEADS),
            small_m_rope_linear,
        ),
        (small_m_rms_norm_qk_norm_rope_linear, qk_args, small_m_qk_norm_rope_linear),
    ]


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The CPU declared a kernel device; records ``"gemv+norm"``, ``"gemv"`` or ``"norm"`` per
    launch of the GEMV (with or without the prologue) and of the norm alone."""
    from pieceworks.kernels.gemv import triton_gemv, triton_gemv_rope

    recorded: list[str] = []

    def gemv(x, weight, config=None, **kwargs):
        recorded.append("gemv+norm" if kwargs.get("norm") is not None else "gemv")
        return launch_gemv(x, weight, config, **kwargs)

    def norm_rows(*args):
        recorded.append("norm")
        return rms_norm_rows(*args)

    monkeypatch.setattr(triton_device, "kernel_runs_on", lambda x: True)
    for module in (triton_gemv, triton_gemv_rope, triton_gemv_norm):
        monkeypatch.setattr(module, "launch_gemv", gemv)
    monkeypatch.setattr(triton_gemv_norm, "rms_norm_rows", norm_rows)
    return recorded


@requires_triton
@pytest.mark.parametrize("num_tokens", [3, 65])
def test_each_op_is_one_gemv_launch_up_to_the_limit_and_the_norm_then_the_op_past_it(
    launches, num_tokens
):
    """3 tokens: the GEMV with the prologue (the qk form then its head norm kernel, not counted);
    65, past the small weights' 64: the norm kernel, then the unfused op (``F.linear`` inside)."""
    dtype = torch.float32
    x, residual, norm_weight = norm_operands(num_tokens, dtype)
    for fused, args, unfused in op_cases(num_tokens, dtype):
        launches.clear()
        output, residual_out = fused(x, residual, norm_weight, EPS, *args)
        assert launches == (["gemv+norm"] if num_tokens <= 64 else ["norm"]), fused.__name__
        normed, new_residual = torch_norm(x, residual, norm_weight)
        assert torch.equal(residual_out, new_residual)
        torch.testing.assert_close(output, unfused(normed, *args), **TOLERANCES[dtype])


@pytest.mark.parametrize("with_residual", [True, False])
def test_on_cpu_tensors_each_op_is_the_torch_norm_then_the_unfused_op(with_residual):
    dtype = torch.bfloat16
    x, residual, norm_weight = norm_operands(3, dtype)
    residual = residual if with_residual else None
    normed, new_residual = torch_norm(x, residual, norm_weight)
    for fused, args, unfused in op_cases(3, dtype):
        output, residual_out = fused(x, residual, norm_weight, EPS, *args)
        assert torch.equal(output, unfused(normed, *args)), fused.__name__
        expected = new_residual if with_residual else x.new_empty((0, HIDDEN))
        assert torch.equal(residual_out, expected)


def test_the_ops_trace_with_a_dynamic_token_count():
    register_norm_gemv_ops()
    x, residual, norm_weight = norm_operands(3, torch.float32)
    weight, _, _ = epilogue_operands("gated", 3, torch.float32)
    op = torch.ops.pieceworks.small_m_rms_norm_silu_and_mul_linear

    def fn(x, residual):
        return op(x, residual, norm_weight, EPS, weight)

    compiled = torch.compile(fn, backend="eager", fullgraph=True, dynamic=True)
    for num_tokens in (3, 5):
        x, residual, _ = norm_operands(num_tokens, torch.float32)
        output, residual_out = compiled(x, residual)
        assert output.shape == (num_tokens, 40) and residual_out.shape == x.shape
        assert torch.equal(output, fn(x, residual)[0])
