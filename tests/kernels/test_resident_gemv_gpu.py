"""The resident-weight FP8 GEMV on a Hopper GPU (``kernels/gemv/resident_gemv.py``).

It proves that the Gluon kernel computes ``x W^T`` times both scales (against a float64
reference, within Hopper's FP8 fast accumulation, as the Triton GEMV), with all chunks resident,
with chunks streamed into freed slots (the 8B ``o_proj`` shape), with rows off the 64-row grid
and 1 to 16 tokens; that its rotary form computes what the GEMM and the rotation do; that it
reads x only after the kernel that writes x has finished, when both are launched with PDL and
replayed in a CUDA graph (the producer releases it at its start, so it is scheduled while the
producer runs); and which shapes take it.
Run on a GPU machine: pytest -m gpu tests/kernels/test_resident_gemv_gpu.py
"""

from __future__ import annotations

import pytest
import torch

from pieceworks.core.norm_quant import KERNEL_FP8_DTYPE, static_scaled_fp8_quant
from pieceworks.kernels.gemv import resident_gemv
from pieceworks.kernels.gemv.resident_gemv import launch_resident_gemv, uses_resident_gemv
from pieceworks.kernels.gemv.triton_gemv import launch_gemv
from pieceworks.kernels.gemv.triton_gemv_config import RopeEpilogue
from pieceworks.kernels.norm_quant.triton_norm_quant import rms_norm_static_fp8_quant

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
        reason="the resident GEMV needs a Hopper GPU",
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


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("num_tokens", [1, 3, 8, 16])
@pytest.mark.parametrize(
    "out_features,in_features",
    [(4096, 4096), (200, 1024), (256, 512)],  # 8B o_proj (M <= 8: 4 chunks streamed); ragged
)
def test_resident_gemv_matches_the_reference_gemm(out_dtype, num_tokens, out_features, in_features):
    """Against float64, as close as the Triton GEMV: both let Hopper's FP8 MMA add in reduced
    precision (about 14 bits kept), which at K = 4096 leaves errors near 1% of the largest
    output on these operands (saturated e4m3 values of both signs)."""
    x_fp8, weight, x_scale, weight_scale = fp8_operands(num_tokens, out_features, in_features)
    if not uses_resident_gemv(x_fp8, weight):
        assert num_tokens > 8 and in_features == 4096  # x's 64 KB leave too few slots
        return
    scales = (x_scale, weight_scale)
    output = launch_resident_gemv(x_fp8, weight, scales, out_dtype)
    assert output.shape == (num_tokens, out_features) and output.dtype == out_dtype
    expected = reference(x_fp8, weight, x_scale, weight_scale)
    largest = expected.abs().max()
    error = ((output.double() - expected).abs().max() / largest).item()
    triton = launch_gemv(x_fp8, weight, scales=scales, out_dtype=out_dtype)
    triton_error = ((triton.double() - expected).abs().max() / largest).item()
    print(f"K={in_features} M={num_tokens}: resident {error:.1e}, Triton GEMV {triton_error:.1e}")
    assert error <= 2e-2 and error <= 3 * triton_error + 2e-3, (error, triton_error)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Largest difference, as a share of the largest expected value."""
    expected = expected.double()
    return ((actual.double() - expected).abs().max() / expected.abs().max()).item()


@pytest.mark.parametrize("num_tokens", [1, 5, 8])
@pytest.mark.parametrize("in_features", [1024, 4096])
def test_resident_rope_gemv_rotates_like_the_unfused_layers(num_tokens, in_features):
    """Merged qkv weight (4 q, 2 k, 2 v heads of 128): q and k rotated (neox) at each token's
    position from values rounded to bfloat16, v as it is; against the float64 GEMM followed by
    the rotation in float32, as close as the Triton GEMV's rotary epilogue. K = 4096 streams
    some chunks into freed slots, as the 8B qkv_proj does."""
    head_size, num_rotary_heads, num_heads = 128, 6, 8
    x_fp8, weight, x_scale, weight_scale = fp8_operands(
        num_tokens, num_heads * head_size, in_features
    )
    generator = torch.Generator(device="cuda").manual_seed(1)
    angles = torch.rand(64, head_size // 2, device="cuda", generator=generator) * 6.3
    cos_sin = torch.cat([angles.cos(), angles.sin()], dim=1).to(torch.bfloat16)  # (P, D)
    positions = torch.randint(0, 64, (num_tokens,), device="cuda", generator=generator)
    rope = RopeEpilogue(positions, cos_sin, head_size, num_rotary_heads)
    scales, bf16 = (x_scale, weight_scale), torch.bfloat16
    output = launch_resident_gemv(x_fp8, weight, scales, bf16, rope)
    assert output.shape == (num_tokens, num_heads * head_size) and output.dtype == bf16
    qkv = reference(x_fp8, weight, x_scale, weight_scale).to(bf16).float()
    heads = qkv.view(num_tokens, num_heads, 2, head_size // 2)  # (T, H, halves, D / 2)
    cos, sin = cos_sin[positions].float().view(num_tokens, 1, 2, head_size // 2).unbind(2)
    first, second = heads[:, :num_rotary_heads].unbind(2)
    rotated = torch.stack([first * cos - second * sin, second * cos + first * sin], dim=2)
    heads[:, :num_rotary_heads] = rotated.to(bf16).float()
    expected = heads.reshape(num_tokens, -1)
    triton = launch_gemv(x_fp8, weight, scales=scales, out_dtype=bf16, rope=rope)
    error, triton_error = relative_error(output, expected), relative_error(triton, expected)
    print(f"rope K={in_features} M={num_tokens}: resident {error:.1e}, Triton {triton_error:.1e}")
    assert error <= 2e-2 and error <= 3 * triton_error + 2e-3, (error, triton_error)


@pytest.mark.parametrize("rotary", [False, True])
def test_resident_gemv_waits_for_the_kernel_that_writes_x(rotary):
    """norm + quant (PDL, releases at its start) writes x, the resident GEMV reads it; in a graph
    replayed with new inputs, each result is the GEMV of that replay's x (rotary: the 8B qkv
    shape, against the Triton GEMV's rotary form on the same x)."""
    hidden = 4096
    _, weight, _, weight_scale = fp8_operands(1, 6144 if rotary else 4096, hidden)
    x_scale = torch.tensor(0.05, device="cuda")
    source = torch.empty(1, hidden, device="cuda", dtype=torch.bfloat16)
    norm_weight = torch.ones(hidden, device="cuda", dtype=torch.bfloat16)
    x_fp8 = torch.empty(1, hidden, device="cuda", dtype=KERNEL_FP8_DTYPE)
    rope = None
    if rotary:
        angles = torch.rand(64, 64, device="cuda", generator=torch.Generator("cuda").manual_seed(2))
        cos_sin = torch.cat([angles.cos(), angles.sin()], dim=1).to(torch.bfloat16)
        positions = torch.tensor([37], device="cuda")
        rope = RopeEpilogue(positions, cos_sin, 128, 40)  # 32 q and 8 k heads of 8B; 8 v heads
    assert uses_resident_gemv(x_fp8, weight, rope)
    scales, out_dtype = (x_scale, weight_scale), torch.bfloat16 if rotary else torch.float32

    def step() -> torch.Tensor:
        rms_norm_static_fp8_quant(x_fp8, source, norm_weight, x_scale, 1e-5)
        return launch_resident_gemv(x_fp8, weight, scales, out_dtype, rope)

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
        if rotary:
            expected = launch_gemv(
                expected_x, weight, scales=scales, out_dtype=out_dtype, rope=rope
            )
        else:
            expected = reference(expected_x, weight, x_scale, weight_scale)
        error = relative_error(output, expected)
        assert error <= 2e-2, (seed, error)  # a stale x would be off by the whole output


def test_which_products_take_the_resident_gemv():
    """The 8B o_proj and qkv_proj (whose heads' halves hold whole 32-pair programs) at up to 8
    tokens; not down_proj (too little of its slice fits), not 16
    tokens at K = 4096 (x takes the slots), not bfloat16."""

    def takes(num_tokens, out_features, in_features, dtype=KERNEL_FP8_DTYPE) -> bool:
        x = torch.zeros(num_tokens, in_features, device="cuda", dtype=dtype)
        weight = torch.zeros(out_features, in_features, device="cuda", dtype=dtype)
        return uses_resident_gemv(x, weight)

    assert takes(1, 4096, 4096) and takes(8, 4096, 4096)
    x, qkv_weight = (torch.zeros(n, 4096, device="cuda", dtype=KERNEL_FP8_DTYPE) for n in (1, 6144))
    for head_size, taken in ((128, True), (64, True), (32, False)):  # pairs of one head only
        rope = RopeEpilogue(torch.zeros(1, device="cuda"), x, head_size, 8)
        assert uses_resident_gemv(x, qkv_weight, rope) is taken, head_size
    assert not takes(1, 4096, 14336) and not takes(16, 4096, 4096)
    assert not takes(1, 4096, 4096, torch.bfloat16)
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert not takes(1, (num_sms + 1) * resident_gemv.BLOCK_N, 1024)  # one wave only
