"""The persistent ring FP8 GEMV on a Hopper GPU (``models/layers/ring_gemv.py``).

It proves that the Gluon kernel computes ``x W^T`` times both scales, and ``silu(gate) * up``
quantized to e4m3 in the gated form, against a float64 reference within Hopper's FP8 fast
accumulation (as close as the Triton GEMV): at the 8B down_proj and gate_up_proj shapes, with
rows off the 64-row grid, 1 to 16 tokens, and grids of a few programs so that each walks several
tiles, unevenly, through its ring; and that it reads x only after the kernel that writes x has
finished when both are launched with PDL and replayed in a CUDA graph.
Run on a GPU machine: pytest -m gpu tests/models/test_ring_gemv_gpu.py
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pieceworks.core.norm_quant import FP8_DTYPE, static_scaled_fp8_quant
from pieceworks.models.layers.quantization.triton_norm_quant import rms_norm_static_fp8_quant
from pieceworks.models.layers.ring_gemv import launch_ring_gemv
from pieceworks.models.layers.triton_gemv import launch_gemv

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
        reason="the ring GEMV needs a Hopper GPU",
    ),
]


def fp8_operands(num_tokens: int, out_features: int, in_features: int):
    """FP8 x and W with per-tensor scales; values spread over the e4m3 range."""
    generator = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(num_tokens, in_features, device="cuda", generator=generator)
    weight = torch.randn(out_features, in_features, device="cuda", generator=generator)
    x_scale = torch.tensor(0.02, device="cuda")
    weight_scale = weight.abs().max() / 448
    x_fp8 = static_scaled_fp8_quant(x, x_scale)
    return x_fp8, static_scaled_fp8_quant(weight, weight_scale), x_scale, weight_scale


def reference(x_fp8, weight, x_scale, weight_scale) -> torch.Tensor:
    return (x_fp8.double() @ weight.double().t()) * (x_scale * weight_scale).double()


def relative_error(output: torch.Tensor, expected: torch.Tensor) -> float:
    return ((output.double() - expected).abs().max() / expected.abs().max()).item()


@pytest.mark.parametrize("num_programs", [None, 3, 7])
@pytest.mark.parametrize("num_tokens", [1, 5, 16])
@pytest.mark.parametrize(
    "out_features,in_features",
    [(4096, 14336), (1000, 4096), (200, 512)],  # 8B down_proj; ragged rows; two-step tiles
)
def test_ring_gemv_matches_the_reference_gemm(num_programs, num_tokens, out_features, in_features):
    """Against float64, as close as the Triton GEMV (both add in Hopper's reduced-precision FP8
    accumulation)."""
    x_fp8, weight, x_scale, weight_scale = fp8_operands(num_tokens, out_features, in_features)
    scales = (x_scale, weight_scale)
    output = launch_ring_gemv(x_fp8, weight, scales, torch.float32, num_programs=num_programs)
    assert output.shape == (num_tokens, out_features) and output.dtype == torch.float32
    expected = reference(x_fp8, weight, x_scale, weight_scale)
    error = relative_error(output, expected)
    triton_error = relative_error(
        launch_gemv(x_fp8, weight, scales=scales, out_dtype=torch.float32), expected
    )
    print(f"K={in_features} M={num_tokens}: ring {error:.1e}, Triton GEMV {triton_error:.1e}")
    assert error <= 2e-2 and error <= 3 * triton_error + 2e-3, (error, triton_error)
    bf16 = launch_ring_gemv(x_fp8, weight, scales, torch.bfloat16, num_programs=num_programs)
    assert bf16.dtype == torch.bfloat16
    torch.testing.assert_close(bf16.float(), output.to(torch.bfloat16).float(), rtol=0, atol=0)


@pytest.mark.parametrize("num_programs", [None, 5])
@pytest.mark.parametrize("num_tokens", [1, 16])
@pytest.mark.parametrize("out_features", [14336, 1000])  # the 8B MLP; gate/up rows off the grid
def test_ring_gemv_gated_matches_the_unfused_product(num_programs, num_tokens, out_features):
    """``silu(gate) * up`` quantized to e4m3 with ``out_scale``: against the float64 product,
    rounded to bfloat16 as an unfused GEMM stores it, then activated and quantized; values may
    differ by one e4m3 step where the accumulation order moves a value across a rounding
    boundary, as the Triton GEMV's do."""
    x_fp8, weight, x_scale, weight_scale = fp8_operands(num_tokens, 2 * out_features, 4096)
    out_scale = torch.tensor(0.05, device="cuda")
    scales = (x_scale, weight_scale)
    output = launch_ring_gemv(
        x_fp8, weight, scales, torch.bfloat16, gated=True, out_scale=out_scale,
        num_programs=num_programs,
    )  # fmt: skip
    assert output.shape == (num_tokens, out_features) and output.dtype == FP8_DTYPE
    gate, up = (
        reference(x_fp8, weight, x_scale, weight_scale).to(torch.bfloat16).float().chunk(2, -1)
    )
    expected = static_scaled_fp8_quant(F.silu(gate) * up, out_scale).float()
    triton = launch_gemv(
        x_fp8, weight, scales=scales, out_dtype=torch.bfloat16, gated=True, out_scale=out_scale
    ).float()
    step = expected.abs() / 8 + 2**-9  # about one e4m3 step of each value
    far = ((output.float() - expected).abs() > step).float().mean().item()
    triton_far = ((triton - expected).abs() > step).float().mean().item()
    print(
        f"gated N={out_features} M={num_tokens}: {far:.1e} off by more than a step "
        f"(Triton {triton_far:.1e})"
    )
    assert far <= max(2 * triton_far, 1e-3), (far, triton_far)


def test_ring_gemv_waits_for_the_kernel_that_writes_x():
    """norm + quant (PDL, releases at its start) writes x, the ring GEMV reads it; in a graph
    replayed with new inputs, each result is the GEMV of that replay's x."""
    hidden = 14336
    _, weight, _, weight_scale = fp8_operands(1, 4096, hidden)
    x_scale = torch.tensor(0.05, device="cuda")
    source = torch.empty(1, hidden, device="cuda", dtype=torch.bfloat16)
    norm_weight = torch.ones(hidden, device="cuda", dtype=torch.bfloat16)
    x_fp8 = torch.empty(1, hidden, device="cuda", dtype=FP8_DTYPE)

    def step() -> torch.Tensor:
        rms_norm_static_fp8_quant(x_fp8, source, norm_weight, x_scale, 1e-5)
        return launch_ring_gemv(x_fp8, weight, (x_scale, weight_scale), torch.float32)

    source.normal_()
    step()  # compile outside the graph
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        output = step()
    for seed in range(4):
        source.copy_(torch.randn(1, hidden, generator=torch.Generator().manual_seed(seed)))
        graph.replay()
        expected_x = torch.empty_like(x_fp8)
        rms_norm_static_fp8_quant(expected_x, source, norm_weight, x_scale, 1e-5)
        expected = reference(expected_x, weight, x_scale, weight_scale)
        assert relative_error(output, expected) <= 2e-2, seed  # a stale x: off by the whole output


def test_which_products_take_the_ring_gemv():
    """The 8B gate_up_proj (448 tiles) at 1 to 16 tokens; not down_proj (64 tiles, K = 14336),
    not o_proj (64 tiles), not bfloat16."""
    from pieceworks.models.layers.ring_gemv import uses_ring_gemv

    def takes(num_tokens, out_features, in_features, dtype=FP8_DTYPE) -> bool:
        x = torch.zeros(num_tokens, in_features, device="cuda", dtype=dtype)
        weight = torch.zeros(out_features, in_features, device="cuda", dtype=dtype)
        return uses_ring_gemv(x, weight, gated=True)

    assert takes(1, 28672, 4096) and takes(16, 28672, 4096)
    assert not takes(1, 4096, 14336) and not takes(1, 4096, 4096)
    assert not takes(1, 28672, 4096, torch.bfloat16)
