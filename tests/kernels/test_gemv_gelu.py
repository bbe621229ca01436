"""The gate/up GEMV with GeGLU as its epilogue: ``pieceworks::small_m_gelu_and_mul_linear``.

Proves that (1) the GEMV's gated epilogue with ``activation="gelu_tanh"`` / ``"gelu"`` equals
``gelu_and_mul`` (tanh / erf) of the product as an unfused GEMM stores it, float32 and bfloat16,
1 and 7 tokens, N off the block grid, and refuses an unknown activation; (2) the op equals the
unfused path it replaces (``small_m_linear`` then the ``gelu_and_mul`` kernel) where the kernels
run, launching the GEMV once with the GELU epilogue, and past the token limit runs ``F.linear``
and the ``gelu_and_mul`` kernel; an unknown ``approximate`` is refused with its name; (3) the op
has a fake and traces under ``torch.compile(fullgraph=True)`` with a dynamic token count; (4) on
a GPU (``gpu``), at Gemma-3-4B's MLP shape (hidden 2560, intermediate 10240, bfloat16, 1, 8 and
16 tokens), the fused op equals the unfused path within one bfloat16 step.

What runs where: as ``test_triton_gemv.py``: without a GPU the kernels run in Triton's interpreter
on CPU tensors (TRITON_INTERPRET=1 set before they are imported, the CPU declared a kernel device
where a test needs the op to launch them). Tolerances: float32 1e-5 (the GELU computed in float32
the same way, only the GEMM's accumulation order differs); bfloat16 one step, where the
interpreter truncates its float32 -> bfloat16 stores (``test_triton_gemv.py``): the unfused
path's stored gate and up then differ by a step each from the epilogue's rounded ones, so the
interpreted comparison of (2) allows three.
Run: TRITON_INTERPRET=1 python -m pytest -q tests/kernels/test_gemv_gelu.py
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels below are decorated

from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from pieceworks.kernels import triton_device  # noqa: E402
from pieceworks.kernels.activation import triton_gelu_and_mul  # noqa: E402
from pieceworks.kernels.activation.torch_activation import gelu_and_mul  # noqa: E402
from pieceworks.kernels.activation.triton_gelu_and_mul import gelu_and_mul_2d  # noqa: E402
from pieceworks.kernels.gemv import triton_gemv  # noqa: E402
from pieceworks.kernels.gemv.triton_gemv import (  # noqa: E402
    GemvConfig,
    launch_gemv,
    small_m_gelu_and_mul_linear,
    small_m_gelu_and_mul_linear_op,
    small_m_linear,
)

INTERPRETED = isinstance(triton_gemv._gemv_kernel, InterpretedFunction)
ON_GPU = not INTERPRETED and torch.cuda.is_available()
DEVICE = torch.device("cuda") if ON_GPU else torch.device("cpu")
requires_triton = pytest.mark.skipif(
    not INTERPRETED and not ON_GPU,
    reason="the Triton GEMV was imported compiled before TRITON_INTERPRET=1 was set and no GPU "
    "is visible: run with TRITON_INTERPRET=1 in the environment",
)
TOLERANCES = {
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.bfloat16: dict(rtol=2**-7, atol=1e-2),
}
APPROXIMATE = {"gelu_tanh": "tanh", "gelu": "none"}  # the epilogue's activation -> F.gelu's


def operands(num_tokens: int, out_features: int, in_features: int, dtype: torch.dtype):
    """x (T, K) and a [gate; up] weight (2N, K) whose products reach |g| ~ 3 (GELU's bend)."""
    generator = torch.Generator().manual_seed(num_tokens * 1000 + out_features + in_features)
    x = torch.randn(num_tokens, in_features, generator=generator)
    weight = torch.randn(2 * out_features, in_features, generator=generator) * 2 / in_features**0.5
    return x.to(DEVICE, dtype), weight.to(DEVICE, dtype)


@pytest.fixture
def kernel_device(monkeypatch):
    """The CPU counts as a kernel device (the interpreter runs the kernels) where there is no
    GPU; the list collects the ``activation`` of every GEMV launch."""
    if not ON_GPU:
        monkeypatch.setattr(triton_device, "kernel_runs_on", lambda x: True)
    activations: list[str | None] = []

    def counted_launch(x, weight, config=None, **epilogue):
        activations.append(epilogue.get("activation") if epilogue.get("gated") else None)
        return launch_gemv(x, weight, config, **epilogue)

    monkeypatch.setattr(triton_gemv, "launch_gemv", counted_launch)
    return activations


@requires_triton
@pytest.mark.parametrize("activation", ["gelu_tanh", "gelu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 7])
def test_gelu_epilogue_is_gelu_and_mul_of_the_stored_product(activation, dtype, num_tokens):
    x, weight = operands(num_tokens, 45, 96, dtype)  # N = 45: off the 16-column block grid
    config = GemvConfig(block_n=16, block_k=32)  # 3 K chunks
    output = launch_gemv(x, weight, config, gated=True, activation=activation)
    assert output.shape == (num_tokens, 45) and output.dtype == dtype
    gate_up = (x.double() @ weight.double().t()).to(dtype)  # what an unfused GEMM stores
    expected = gelu_and_mul(gate_up.double(), APPROXIMATE[activation])
    torch.testing.assert_close(output.double(), expected, **TOLERANCES[dtype])


@requires_triton
def test_an_unknown_activation_is_refused():
    x, weight = operands(1, 16, 32, torch.float32)
    with pytest.raises(ValueError, match="activation='relu'"):
        launch_gemv(x, weight, gated=True, activation="relu")


@requires_triton
@pytest.mark.parametrize("approximate", ["tanh", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_op_equals_the_unfused_gemv_and_gelu_and_mul(kernel_device, approximate, dtype):
    x, weight = operands(3, 40, 64, dtype)
    fused = small_m_gelu_and_mul_linear(x, weight, approximate)
    assert kernel_device == [f"gelu{'_tanh' if approximate == 'tanh' else ''}"]  # one GEMV
    unfused = gelu_and_mul_2d(small_m_linear(x, weight), approximate)  # GEMV, gelu kernel
    assert kernel_device[1:] == [None]
    tolerance = TOLERANCES[dtype]
    if INTERPRETED and dtype == torch.bfloat16:  # the unfused GEMV's stores of gate and up
        tolerance = dict(rtol=3 * 2**-7, atol=1e-2)  # truncate: a step each, then the result's
    torch.testing.assert_close(fused.float(), unfused.float(), **tolerance)
    with pytest.raises(ValueError, match="approximate='fast'"):
        small_m_gelu_and_mul_linear(x, weight, "fast")


@requires_triton
def test_past_the_token_limit_the_op_runs_f_linear_and_the_gelu_kernel(kernel_device, monkeypatch):
    calls = []
    launch = triton_gelu_and_mul.launch
    monkeypatch.setattr(
        triton_gelu_and_mul, "launch", lambda *a, **k: calls.append(1) or launch(*a, **k)
    )
    x, weight = operands(65, 8, 16, torch.float32)  # a small weight takes the GEMV to 64 tokens
    output = small_m_gelu_and_mul_linear(x, weight, "tanh")
    assert kernel_device == [] and calls == [1]
    torch.testing.assert_close(output, gelu_and_mul(F.linear(x, weight), "tanh"), rtol=1e-5,
                               atol=1e-5)  # fmt: skip


def test_op_has_a_fake_and_traces_with_a_dynamic_token_count():
    op = small_m_gelu_and_mul_linear_op()
    assert op is torch.ops.pieceworks.small_m_gelu_and_mul_linear
    weight = torch.randn(24, 16, device=DEVICE)  # the op is registered for the platform's device
    assert op(torch.empty(5, 16, device="meta"), weight.to("meta"), "tanh").shape == (5, 12)
    compiled = torch.compile(
        lambda t: op(t, weight, "tanh") + 1, backend="eager", fullgraph=True, dynamic=True
    )
    for num_tokens in (2, 3):  # on the CPU the op runs its torch form inside
        x = torch.randn(num_tokens, 16, device=DEVICE)
        expected = gelu_and_mul(F.linear(x, weight), "tanh") + 1
        torch.testing.assert_close(compiled(x), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a GPU (the kernels compiled)")
@pytest.mark.parametrize("num_tokens", [1, 8, 16])
def test_gemma3_4b_mlp_shape_on_the_gpu(num_tokens):
    """Gemma-3-4B's gate/up projection: hidden 2560, intermediate 10240, bfloat16."""
    hidden, intermediate = 2560, 10240
    x, weight = operands(num_tokens, intermediate, hidden, torch.bfloat16)
    fused = small_m_gelu_and_mul_linear(x, weight, "tanh")
    unfused = gelu_and_mul_2d(small_m_linear(x, weight), "tanh")
    assert fused.shape == (num_tokens, intermediate)
    torch.testing.assert_close(fused.float(), unfused.float(), rtol=2**-7, atol=1e-2)
    gate_up = (x.double() @ weight.double().t()).to(torch.bfloat16)
    expected = gelu_and_mul(gate_up.double(), "tanh")
    torch.testing.assert_close(fused.double(), expected, rtol=2**-7, atol=2e-2)
