"""The residual add + RMSNorm + FP8 quant split between two FP8 GEMVs (``fp8_norm_split.py``).

Proves that (1) the producer ``small_m_fp8_linear_add`` on the kernel path stores ``y + residual``
(y rounded to the output dtype as the GEMM stores it) as the new residual and in float32, and the
sums of its squares over each 64 columns; (2) the consumer ``small_m_fp8_normed_linear`` on the
kernel path (each K chunk normalised and quantized inside the loop, for the real tokens' rows)
gives what the unfused ops give, fused norm + quant then the GEMV with the same epilogue (plain,
SiLU-and-mul with FP8 output, rotary), for 1, 5 and 16 tokens, bfloat16 and float32; (3) past 16
tokens, or where the kernel does not run, both ops compute the same values with torch; (4) a wrong
epilogue or missing epilogue operands are refused with a ValueError; (5) in FP8 llama-tiny
compiled by Inductor with fusion on, ``NormSplitPass`` splits every residual-form norm that sits
between two GEMVs (3 of the 5 norms) and the model decodes what eager FP8 decodes.

What runs where: as in ``test_triton_gemv.py``; on CPU the kernels run interpreted
(``triton_launch.kernel_runs_on`` patched). The consumer is checked on sums whose squares add up
exactly in any order (multiples of 1/8), so there it is byte-identical to the unfused ops; on a
GPU ``rsqrt`` may differ by an ulp, and a value may round to the neighbouring bfloat16 (and e4m3).
Run: TRITON_INTERPRET=1 python -m pytest -q tests/models/test_fp8_norm_split.py -p no:cacheprovider
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernel below is decorated

from pieceworks.core.norm_quant import (  # noqa: E402
    FP8_DTYPE,
    add_rms_norm,
    num_partials,
    static_scaled_fp8_quant,
)
from pieceworks.models.layers import triton_launch  # noqa: E402
from pieceworks.models.layers.quantization import fp8_norm_split  # noqa: E402
from pieceworks.models.layers.quantization.fp8 import (  # noqa: E402
    fp8_gemm,
    quantize_weight_per_tensor,
)
from pieceworks.models.layers.triton_gemv import launch_gemv  # noqa: E402
from pieceworks.models.layers.triton_gemv_rope import rope_epilogue  # noqa: E402
from tests.models.test_triton_gemv import (  # noqa: E402
    DEVICE,
    INTERPRETED,
    ON_GPU,
    requires_triton,
)

EPS = 1e-5
HIDDEN, HEAD_SIZE, NUM_HEADS = 320, 32, 3  # 5 partials per token; rope: 3 heads, 2 rotated
IN_FEATURES = 96  # the producer's K


@pytest.fixture
def kernels_on_cpu(monkeypatch):
    monkeypatch.setattr(triton_launch, "kernel_runs_on", lambda x: True)


def producer_operands(num_tokens: int, dtype: torch.dtype) -> dict:
    generator = torch.Generator().manual_seed(num_tokens)
    x = torch.randn(num_tokens, IN_FEATURES, generator=generator).to(DEVICE)
    weight, weight_scale = quantize_weight_per_tensor(
        (torch.randn(HIDDEN, IN_FEATURES, generator=generator) / IN_FEATURES**0.5).to(DEVICE)
    )
    input_scale = torch.tensor(0.02, device=DEVICE)
    residual = torch.randn(num_tokens, HIDDEN, generator=generator).to(DEVICE, dtype)
    return dict(
        x_fp8=static_scaled_fp8_quant(x, input_scale),
        weight=weight,
        input_scale=input_scale,
        weight_scale=weight_scale,
        residual=residual,
        out_dtype=dtype,
        native=False,
    )


@requires_triton
@pytest.mark.parametrize("num_tokens", [1, 5, 16])
def test_producer_adds_the_residual_and_sums_squares(kernels_on_cpu, num_tokens):
    # float32 output: the GEMV's own result is its exact reference (the same kernel tiles)
    args = producer_operands(num_tokens, torch.float32)
    residual_out, sums, partials = fp8_norm_split.small_m_fp8_linear_add(**args)
    output = launch_gemv(
        args["x_fp8"],
        args["weight"],
        scales=(args["input_scale"], args["weight_scale"]),
        out_dtype=torch.float32,
    )
    expected = output + args["residual"]
    if INTERPRETED:
        assert torch.equal(sums, expected) and torch.equal(residual_out, expected)
    else:  # the GPU may fuse the scale's multiply and the residual's add into one FMA
        torch.testing.assert_close(sums, expected, rtol=1e-6, atol=1e-6)
        assert torch.equal(residual_out, sums)
    assert partials.shape == (num_tokens, num_partials(HIDDEN))
    by_column_block = (expected * expected).view(num_tokens, -1, 64).sum(dim=-1)
    torch.testing.assert_close(partials, by_column_block, rtol=1e-6, atol=0)


@requires_triton
@pytest.mark.parametrize("num_tokens", [1, 5, 16])
def test_producer_rounds_the_output_before_the_add(kernels_on_cpu, num_tokens):
    args = producer_operands(num_tokens, torch.bfloat16)
    residual_out, sums, partials = fp8_norm_split.small_m_fp8_linear_add(**args)
    operands = (args["x_fp8"], args["weight"], args["input_scale"], args["weight_scale"])
    output = fp8_gemm(*operands, torch.bfloat16, None, False)  # rounded as cuBLAS stores it
    expected = fp8_norm_split.residual_sums(output, args["residual"])
    # the kernel adds its products in another order (on Hopper in reduced precision): at most a
    # bfloat16 rounding of the output apart, which the residual's larger values round again
    tolerance = dict(rtol=2**-7, atol=2**-6)
    torch.testing.assert_close(residual_out.float(), expected[0].float(), **tolerance)
    torch.testing.assert_close(sums, expected[1], **tolerance)
    torch.testing.assert_close(partials, expected[2], rtol=1e-2, atol=0)
    assert residual_out.dtype == torch.bfloat16 and torch.equal(residual_out, sums.bfloat16())


def consumer_operands(num_tokens: int, dtype: torch.dtype, epilogue: str) -> dict:
    """Sums that are multiples of 1/8 below 16 in magnitude: their squares add up exactly."""
    generator = torch.Generator().manual_seed(num_tokens)
    sums = torch.randint(-128, 128, (num_tokens, HIDDEN), generator=generator) / 8.0
    partials = (sums * sums).view(num_tokens, -1, 64).sum(dim=-1)
    norm_weight = (1 + 0.1 * torch.randn(HIDDEN, generator=generator)).to(dtype)
    out_rows = {"linear": 96, "silu_and_mul": 128, "rope": NUM_HEADS * HEAD_SIZE}[epilogue]
    full = torch.randn(out_rows, HIDDEN, generator=generator) / HIDDEN**0.5
    weight, weight_scale = quantize_weight_per_tensor(full.to(DEVICE, dtype))
    positions = torch.randint(0, 64, (num_tokens,), generator=generator).to(DEVICE)
    angles = torch.arange(64)[:, None] * torch.linspace(0.05, 1.0, HEAD_SIZE // 2)[None, :]
    cos_sin_cache = torch.cat([angles.cos(), angles.sin()], dim=1).to(DEVICE, dtype)
    return dict(
        sums=sums.to(DEVICE),
        partials=partials.to(DEVICE),
        norm_weight=norm_weight.to(DEVICE),
        epsilon=EPS,
        weight=weight,
        input_scale=torch.tensor(0.02, device=DEVICE),
        weight_scale=weight_scale,
        epilogue=epilogue,
        out_scale=torch.tensor(0.01, device=DEVICE) if epilogue == "silu_and_mul" else None,
        positions=positions if epilogue == "rope" else None,
        cos_sin_cache=cos_sin_cache if epilogue == "rope" else None,
        head_size=HEAD_SIZE,
        num_rotary_heads=2,
        out_dtype=dtype,
        native=False,
    )


def unsplit(args: dict) -> torch.Tensor:
    """What the split replaces: add + norm + quant (the sums as the input, a zero residual),
    then the GEMV kernel with the same epilogue."""
    dtype = args["out_dtype"]
    sums = args["sums"].to(dtype)  # exact: multiples of 1/8 below 16
    normed, _ = add_rms_norm(sums, torch.zeros_like(sums), args["norm_weight"], EPS)
    x_fp8 = static_scaled_fp8_quant(normed, args["input_scale"])
    rope = None
    if args["epilogue"] == "rope":
        rope = rope_epilogue(args["positions"], args["cos_sin_cache"], HEAD_SIZE, 2)
    return launch_gemv(
        x_fp8,
        args["weight"],
        scales=(args["input_scale"], args["weight_scale"]),
        gated=args["epilogue"] == "silu_and_mul",
        rope=rope,
        out_dtype=dtype,
        out_scale=args["out_scale"],
    )


def assert_matches(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    if INTERPRETED:
        assert torch.equal(actual.view(torch.uint8), expected.view(torch.uint8))
    else:  # a neighbouring rounding of a normalised value moves an output by a fraction of it
        rtol = 2**-3 if actual.dtype == FP8_DTYPE else 2**-6
        torch.testing.assert_close(actual.float(), expected.float(), rtol=rtol, atol=1e-2)


@requires_triton
@pytest.mark.parametrize("epilogue", fp8_norm_split.EPILOGUES)
@pytest.mark.parametrize("num_tokens", [1, 5, 16])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_consumer_equals_norm_then_gemv(monkeypatch, kernels_on_cpu, epilogue, num_tokens, dtype):
    launches: list = []

    def recorded_launch(x, weight, config=None, **kwargs):
        launches.append(kwargs.get("norm"))
        return launch_gemv(x, weight, config, **kwargs)

    monkeypatch.setattr(fp8_norm_split, "launch_gemv", recorded_launch)
    args = consumer_operands(num_tokens, dtype, epilogue)
    output = fp8_norm_split.small_m_fp8_normed_linear(**args)
    assert len(launches) == 1 and launches[0] is not None  # one launch, normalising its input
    assert_matches(output, unsplit(args))


@requires_triton
@pytest.mark.parametrize("epilogue", fp8_norm_split.EPILOGUES)
def test_consumer_fallback_computes_the_same(kernels_on_cpu, epilogue):
    args = consumer_operands(17, torch.bfloat16, epilogue)  # past MAX_GEMV_TOKENS
    assert not fp8_norm_split.uses_norm_kernel(
        args["sums"], args["partials"], args["norm_weight"], args["weight"], epilogue,
        args["cos_sin_cache"], HEAD_SIZE, torch.bfloat16,
    )  # fmt: skip
    output = fp8_norm_split.small_m_fp8_normed_linear(**args)
    expected = unsplit(args)  # 17 tokens fit the kernel itself
    # The fallback GEMM is fp8_gemm's float32 matmul, not the kernel: the same FP8 operands, so
    # the results differ only by where they round (bfloat16, or e4m3 after SiLU-and-mul).
    assert output.dtype == expected.dtype and output.shape == expected.shape
    rtol = 2**-3 if output.dtype == FP8_DTYPE else 2**-7
    torch.testing.assert_close(output.float(), expected.float(), rtol=rtol, atol=2e-3)
    normed = fp8_norm_split.normed_fp8_input(
        args["sums"], args["partials"], args["norm_weight"], EPS, args["input_scale"]
    )
    reference, _ = add_rms_norm(
        args["sums"].bfloat16(), torch.zeros_like(args["sums"]).bfloat16(), args["norm_weight"], EPS
    )
    assert torch.equal(normed, static_scaled_fp8_quant(reference, args["input_scale"]))


@requires_triton
def test_producer_fallback_computes_the_same(monkeypatch):
    args = producer_operands(17, torch.bfloat16)  # past MAX_GEMV_TOKENS
    residual_out, sums, partials = fp8_norm_split.small_m_fp8_linear_add(**args)
    operands = (args["x_fp8"], args["weight"], args["input_scale"], args["weight_scale"])
    output = fp8_gemm(*operands, torch.bfloat16, None, False)
    expected = output.float() + args["residual"].float()
    assert torch.equal(sums, expected) and torch.equal(residual_out, expected.bfloat16())
    assert partials.shape == (17, num_partials(HIDDEN))
    torch.testing.assert_close(partials, (expected**2).view(17, -1, 64).sum(-1))


def test_wrong_epilogue_or_missing_operands_are_refused():
    args = consumer_operands(1, torch.float32, "linear")
    with pytest.raises(ValueError, match="epilogue 'gelu'"):
        fp8_norm_split.small_m_fp8_normed_linear(**{**args, "epilogue": "gelu"})
    with pytest.raises(ValueError, match="needs out_scale"):
        fp8_norm_split.small_m_fp8_normed_linear(**{**args, "epilogue": "silu_and_mul"})
    with pytest.raises(ValueError, match="needs positions"):
        fp8_norm_split.small_m_fp8_normed_linear(**{**args, "epilogue": "rope"})
    with pytest.raises(ValueError, match="float32 sums"):
        launch_gemv(args["sums"].bfloat16(), args["weight"], scales=(args["input_scale"],) * 2,
                    out_dtype=torch.float32, norm=object())  # fmt: skip


@requires_triton
@pytest.mark.inductor
def test_llama_fp8_splits_its_norms_between_the_gemvs(kernels_on_cpu, monkeypatch):
    """Compiled with fusion, every decode step of FP8 llama-tiny runs its residual-form norms
    inside the GEMVs: pieces hold 0, 2 and 1 split pairs (layer 0's input norm reads the
    embedding, the final norm is not quantized) and no fused residual-form norm is left; the
    tokens are eager FP8's and the logits those of the unsplit ops up to summation order."""
    from pieceworks.core.passes.pass_manager import PostGradPassManager
    from tests.core.passes.graph_backend import op_counts
    from tests.models.test_triton_gemv import greedy_decode

    after: list = []
    original_call = PostGradPassManager.__call__

    def spy(manager, graph):
        original_call(manager, graph)
        after.append(op_counts(graph))

    monkeypatch.setattr(PostGradPassManager, "__call__", spy)
    split_launches: list[str] = []

    def recorded_launch(x, weight, config=None, **kwargs):
        split_launches.append("producer" if kwargs.get("residual") else "consumer")
        return launch_gemv(x, weight, config, **kwargs)

    monkeypatch.setattr(fp8_norm_split, "launch_gemv", recorded_launch)
    monkeypatch.setenv("PIECEWORKS_SMALL_M_GEMV", "1")
    eager_tokens, eager_logits = greedy_decode(num_tokens=4, level=0, quantization="fp8")
    compilation = {
        "backend": "inductor",
        "pass_config": {"enable_fusion": True},
        "inductor_compile_config": {"fx_graph_cache": False},  # the passes must really run
    }
    tokens, logits = greedy_decode(4, level=3, quantization="fp8", compilation_config=compilation)
    producers = [counts["pieceworks.small_m_fp8_linear_add.default"] for counts in after]
    consumers = [counts["pieceworks.small_m_fp8_normed_linear.default"] for counts in after]
    fused = [counts["pieceworks.fused_add_rms_norm_static_fp8_quant.default"] for counts in after]
    assert (producers, consumers, fused) == ([0, 2, 1], [0, 2, 1], [0, 0, 0])
    # The decode steps ran both halves of the 3 splits as kernels (the prefill, 29 tokens, took
    # the torch path): on CPU 3 steps, each launching; on a GPU the captured graphs replay
    # what was launched while they were captured.
    assert split_launches[:6] == ["producer", "consumer"] * 3
    if not ON_GPU:
        assert split_launches == ["producer", "consumer"] * 3 * 3
    assert tokens == eager_tokens
    tolerance = 5e-3 if ON_GPU else 1e-4  # GPU: cuBLAS and the FP8 MMA each round their sums
    for actual, expected in zip(logits, eager_logits, strict=True):
        torch.testing.assert_close(actual, expected, rtol=tolerance, atol=tolerance)
