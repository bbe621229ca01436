"""``gelu_and_mul``: the torch form is ``F.gelu(gate) * up``, the Triton kernel equals it, the op
and the layer route as the chooser says.

Proves that (1) the torch form is torch's gelu (erf and tanh) of the gate times up, on 2-D and
batched inputs; (2) the kernel equals the torch form for both approximations, float32 (1e-5) and
bfloat16 / float16 (one step of the dtype), with the columns off the block grid and several
column blocks, zero tokens and a strided input (the torch form, inside the op); (3) the op
``pieceworks::gelu_and_mul`` has a fake that gives the shape and traces under
``torch.compile(fullgraph=True)``; (4) ``GeluAndMul`` calls the op where the chooser gives
``gelu_and_mul`` its kernel (a fake H200) and the torch form on the CPU, refuses an unknown
``approximate`` and takes a platform's own registration.

What runs where: where no GPU is visible the kernel runs in Triton's interpreter on CPU tensors
(this module sets TRITON_INTERPRET=1 before the kernel is imported, like
``test_triton_gemv.py``), with the CPU declared a kernel device (``triton_device.kernel_runs_on``
patched to True); on a GPU machine the same tests run compiled (``gpu`` marker).
Run: TRITON_INTERPRET=1 python -m pytest -q tests/kernels/test_triton_gelu_and_mul.py
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernel below is decorated

from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from pieceworks.kernels import triton_device  # noqa: E402
from pieceworks.kernels.activation import triton_gelu_and_mul  # noqa: E402
from pieceworks.kernels.activation.torch_activation import gelu_and_mul  # noqa: E402
from pieceworks.kernels.activation.triton_gelu_and_mul import (  # noqa: E402
    gelu_and_mul_2d,
    gelu_and_mul_op,
)
from pieceworks.kernels.chooser import KernelChooser  # noqa: E402
from pieceworks.kernels.registry import register_kernel, unregister_kernel  # noqa: E402
from pieceworks.models.layers.activation import GeluAndMul  # noqa: E402
from pieceworks.platforms.capability import nvidia_capability  # noqa: E402

INTERPRETED = isinstance(triton_gelu_and_mul._gelu_and_mul_kernel, InterpretedFunction)
ON_GPU = not INTERPRETED and torch.cuda.is_available()
DEVICE = torch.device("cuda") if ON_GPU else torch.device("cpu")
requires_triton = pytest.mark.skipif(
    not INTERPRETED and not ON_GPU,
    reason="the kernel was imported compiled before TRITON_INTERPRET=1 was set and no GPU is "
    "visible: run with TRITON_INTERPRET=1 in the environment",
)
H200 = nvidia_capability(9, 0, num_compute_units=132, shared_memory_per_block=232448)
# float32: exp-based tanh and float32 arithmetic; bfloat16 / float16: one step of the dtype (the
# kernel rounds once, torch rounds gelu(gate) and then the product)
TOLERANCES = {
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.bfloat16: dict(rtol=2**-7, atol=1e-2),
    torch.float16: dict(rtol=2**-10, atol=1e-3),
}


@pytest.fixture
def kernel_device(monkeypatch):
    """The CPU counts as a kernel device (the interpreter runs it) where there is no GPU."""
    if not ON_GPU:
        monkeypatch.setattr(triton_device, "kernel_runs_on", lambda x: True)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_torch_form_is_gelu_of_the_gate_times_up(approximate):
    torch.manual_seed(0)
    x = torch.randn(3, 10) * 3
    expected = F.gelu(x[:, :5], approximate=approximate) * x[:, 5:]
    torch.testing.assert_close(gelu_and_mul(x, approximate), expected)
    batched = torch.randn(2, 3, 8)
    torch.testing.assert_close(
        gelu_and_mul(batched, approximate),
        F.gelu(batched[..., :4], approximate=approximate) * batched[..., 4:],
    )


def _run_kernel_cases() -> None:
    torch.manual_seed(1)
    for dtype, tolerance in TOLERANCES.items():
        for approximate in ("none", "tanh"):
            # 1100 columns: two blocks of 1024, the second partial; 5 tokens; large gates too
            x = (torch.randn(5, 2 * 1100, device=DEVICE) * 4).to(dtype)
            expected = gelu_and_mul(x.float(), approximate).to(dtype)
            output = gelu_and_mul_2d(x, approximate)
            assert output.dtype == dtype and output.shape == (5, 1100)
            torch.testing.assert_close(output.float(), expected.float(), **tolerance)


@requires_triton
def test_kernel_matches_torch(kernel_device, monkeypatch):
    calls = []
    launch = triton_gelu_and_mul.launch
    monkeypatch.setattr(
        triton_gelu_and_mul, "launch", lambda *a, **k: calls.append(1) or launch(*a, **k)
    )
    _run_kernel_cases()
    assert len(calls) == 2 * len(TOLERANCES)  # every case ran the kernel, not the fallback


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_kernel_matches_torch_compiled_on_the_gpu():
    assert not INTERPRETED
    _run_kernel_cases()


@requires_triton
def test_zero_tokens_and_a_strided_input(kernel_device, monkeypatch):
    assert gelu_and_mul_2d(torch.empty(0, 8, device=DEVICE), "tanh").shape == (0, 4)
    monkeypatch.setattr(triton_gelu_and_mul, "launch", pytest.fail)  # the torch form only
    strided = torch.randn(8, 3, device=DEVICE).t()  # (3, 8), column stride 3
    torch.testing.assert_close(gelu_and_mul_2d(strided, "tanh"), gelu_and_mul(strided, "tanh"))
    with pytest.raises(ValueError, match="approximate='fast'"):
        gelu_and_mul_2d(strided, "fast")


def test_op_has_a_fake_and_traces():
    op = gelu_and_mul_op()
    assert op is torch.ops.pieceworks.gelu_and_mul
    assert op(torch.empty(3, 10, device="meta"), "tanh").shape == (3, 5)
    x = torch.randn(4, 12, device=DEVICE)  # the op is registered for the platform's device
    compiled = torch.compile(lambda t: op(t, "tanh") + 1, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(x), gelu_and_mul(x, "tanh") + 1)


def test_layer_calls_the_op_where_the_chooser_gives_the_kernel(fresh_platform, monkeypatch):
    monkeypatch.setenv("PIECEWORKS_PLATFORM", "cpu")
    on_h200, on_cpu = GeluAndMul("tanh"), GeluAndMul("none")
    on_h200.choose_kernels(KernelChooser("cuda", H200))
    on_cpu.choose_kernels(KernelChooser.for_current_platform())
    assert KernelChooser("cuda", H200).choose("gelu_and_mul").impl.name == "triton_gelu_and_mul"
    assert on_h200.uses_op and not on_cpu.uses_op
    x = torch.randn(3, 16)
    torch.testing.assert_close(on_h200(x), gelu_and_mul(x, "tanh"))  # the op, torch inside
    torch.testing.assert_close(on_cpu(x), gelu_and_mul(x, "none"))
    with pytest.raises(ValueError, match="approximate='sigmoid' is not supported"):
        GeluAndMul("sigmoid")


def test_layer_takes_a_platform_registration(fresh_platform, monkeypatch):
    monkeypatch.setenv("PIECEWORKS_PLATFORM", "cpu")
    register_kernel("gelu_and_mul", lambda x, approximate: x[:, :1] * 0, name="own", platform="cpu")
    try:
        layer = GeluAndMul()
        layer.choose_kernels(KernelChooser.for_current_platform())
        assert torch.equal(layer(torch.ones(2, 4)), torch.zeros(2, 1))
    finally:
        unregister_kernel("gelu_and_mul", "own")
