"""The FP8 GEMV with the residual add + RMSNorm + FP8 quant after it (``fp8_linear_norm.py``).

Proves that (1) ``small_m_fp8_linear_add_rms_norm`` on the kernel path (the GEMV's epilogue adds
the residual and sums squares per 64 columns; its last program normalises and quantizes the row)
gives what the two ops it replaces give, the GEMV and then the fused add + norm + quant, for 1, 3
and 4 tokens, float32 and bfloat16 models, and leaves the ticket counter at zero, so a second
launch gives the same; (2) past ``MAX_NORM_TAIL_TOKENS`` tokens, or where the kernel does not
run, it runs exactly those two ops; (3) in FP8 llama-tiny compiled by Inductor with fusion on,
``LinearNormFoldPass`` folds every residual-form norm that follows an FP8 GEMV (3 of the 5 norms)
and the model decodes what eager FP8 decodes.

What runs where: as in ``test_triton_gemv.py``; on CPU the kernel runs interpreted
(``triton_launch.kernel_runs_on`` patched; the interpreter runs the programs one after another,
so the last ticket is the last program), and the results are byte-identical. On a GPU (fast FP8
accumulation, the scale's multiply fused with the add, another order of the squares' sum) a
value may round to its neighbour: there the comparison allows one e4m3 step on a few values.
Run: TRITON_INTERPRET=1 python -m pytest -q tests/models/test_fp8_linear_norm.py -p no:cacheprovider
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernel below is decorated

from pieceworks.core.norm_quant import FP8_DTYPE, static_scaled_fp8_quant  # noqa: E402
from pieceworks.models.layers import triton_gemv_norm, triton_launch  # noqa: E402
from pieceworks.models.layers.quantization import fp8_linear_norm  # noqa: E402
from pieceworks.models.layers.quantization.fp8 import (  # noqa: E402
    quantize_weight_per_tensor,
    small_m_fp8_linear,
)
from pieceworks.models.layers.quantization.norm_quant_ops import (  # noqa: E402
    register_norm_quant_ops,
)
from pieceworks.models.layers.triton_gemv import launch_gemv  # noqa: E402
from tests.models.test_triton_gemv import (  # noqa: E402
    DEVICE,
    INTERPRETED,
    ON_GPU,
    requires_triton,
)

EPS = 1e-5
HIDDEN, IN_FEATURES = 320, 96  # 5 GEMV programs of 64 columns: 5 partial sums per token


@pytest.fixture
def kernels_on_cpu(monkeypatch):
    monkeypatch.setattr(triton_launch, "kernel_runs_on", lambda x: True)
    register_norm_quant_ops()  # the fallback path calls the fused norm op


def operands(num_tokens: int, dtype: torch.dtype) -> dict:
    generator = torch.Generator().manual_seed(num_tokens)
    x = torch.randn(num_tokens, IN_FEATURES, generator=generator).to(DEVICE)
    weight = torch.randn(HIDDEN, IN_FEATURES, generator=generator) / IN_FEATURES**0.5
    weight, weight_scale = quantize_weight_per_tensor(weight.to(DEVICE))
    input_scale = torch.tensor(0.02, device=DEVICE)
    return dict(
        x_fp8=static_scaled_fp8_quant(x, input_scale),
        weight=weight,
        input_scale=input_scale,
        weight_scale=weight_scale,
        residual=torch.randn(num_tokens, HIDDEN, generator=generator).to(DEVICE, dtype),
        norm_weight=(1 + 0.1 * torch.randn(HIDDEN, generator=generator)).to(DEVICE, dtype),
        epsilon=EPS,
        scale=torch.tensor(0.01, device=DEVICE),
        out_dtype=dtype,
        native=False,
    )


def unfolded(args: dict, round_by_torch: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The two ops the fold replaces: the small-M FP8 GEMV, then the fused add + norm + quant.
    ``round_by_torch``: the GEMV's float32 result rounded by torch (to nearest, as a GPU stores
    it; the interpreter's own cast truncates), else the op's own output dtype."""
    dtype = torch.float32 if round_by_torch else args["out_dtype"]
    output = small_m_fp8_linear(args["x_fp8"], args["weight"], args["input_scale"],
                                args["weight_scale"], None, dtype, False)  # fmt: skip
    output = output.to(args["out_dtype"])
    result = torch.empty(output.shape, dtype=FP8_DTYPE, device=DEVICE)
    residual_out = torch.empty_like(output)
    torch.ops.pieceworks.fused_add_rms_norm_static_fp8_quant(
        result, residual_out, output, args["residual"], args["norm_weight"], args["scale"], EPS
    )
    return result, residual_out


def assert_close_fp8(actual: torch.Tensor, expected: torch.Tensor, exact: bool) -> None:
    """Byte-identical, or (``exact`` False) at most one e4m3 step apart on at most 1% of values."""
    assert actual.dtype == expected.dtype == FP8_DTYPE and actual.shape == expected.shape
    if exact:
        assert torch.equal(actual.view(torch.uint8), expected.view(torch.uint8))
        return
    differ = actual.view(torch.uint8) != expected.view(torch.uint8)
    assert int(differ.sum()) <= max(1, differ.numel() // 100)
    torch.testing.assert_close(actual.float(), expected.float(), rtol=2**-3, atol=2**-9)


@requires_triton
@pytest.mark.parametrize("num_tokens", [1, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_tail_equals_gemv_then_fused_norm(monkeypatch, kernels_on_cpu, num_tokens, dtype):
    launches: list = []

    def recorded_launch(x, weight, config=None, **kwargs):
        launches.append(kwargs.get("residual"))
        return launch_gemv(x, weight, config, **kwargs)

    monkeypatch.setattr(fp8_linear_norm, "launch_gemv", recorded_launch)
    args = operands(num_tokens, dtype)
    result, residual_out = fp8_linear_norm.small_m_fp8_linear_add_rms_norm(**args)
    assert len(launches) == 1 and launches[0].norm_weight is not None  # one launch, with the tail
    expected_result, expected_residual = unfolded(args)
    exact = INTERPRETED
    if exact:
        assert torch.equal(residual_out, expected_residual)
    else:  # one rounding of the GEMM's output apart, on the residual's scale
        torch.testing.assert_close(residual_out.float(), expected_residual.float(),
                                   rtol=2**-7, atol=2**-6)  # fmt: skip
    assert_close_fp8(result, expected_result, exact)
    counter = triton_gemv_norm.norm_counter(result.device)
    assert int(counter.item()) == 0  # reset by the last program, for the next launch
    again, _ = fp8_linear_norm.small_m_fp8_linear_add_rms_norm(**args)
    assert torch.equal(again.view(torch.uint8), result.view(torch.uint8))


@requires_triton
def test_past_the_tail_tokens_the_two_ops_run(monkeypatch, kernels_on_cpu):
    num_tokens = fp8_linear_norm.MAX_NORM_TAIL_TOKENS + 1
    args = operands(num_tokens, torch.bfloat16)
    assert not fp8_linear_norm.uses_norm_tail(
        args["x_fp8"], args["weight"], args["residual"], args["norm_weight"], torch.bfloat16
    )
    result, residual_out = fp8_linear_norm.small_m_fp8_linear_add_rms_norm(**args)
    expected_result, expected_residual = unfolded(args, round_by_torch=False)
    assert torch.equal(residual_out, expected_residual)
    assert torch.equal(result.view(torch.uint8), expected_result.view(torch.uint8))


def test_norm_tail_operands_are_checked():
    args = operands(1, torch.float32)
    scratch = torch.empty(1, HIDDEN)
    norm = triton_gemv_norm.ResidualNorm(args["residual"], scratch, scratch, args["norm_weight"])
    with pytest.raises(ValueError, match="needs result and scale"):
        triton_gemv_norm.residual_arguments(norm, args["x_fp8"])


@requires_triton
@pytest.mark.inductor
def test_llama_fp8_folds_its_norms_into_the_gemvs(kernels_on_cpu, monkeypatch):
    """Compiled with fusion, FP8 llama-tiny's residual-form norms run inside the GEMV before
    them: pieces hold 0, 2 and 1 folded ops (layer 0's input norm reads the embedding, the
    final norm is not quantized) and no fused residual-form norm is left; the decode steps run
    the norm as the GEMV's tail, and the tokens are eager FP8's."""
    from pieceworks.core.passes.pass_manager import PostGradPassManager
    from tests.core.passes.graph_backend import op_counts
    from tests.models.test_triton_gemv import greedy_decode

    after: list = []
    original_call = PostGradPassManager.__call__

    def spy(manager, graph):
        original_call(manager, graph)
        after.append(op_counts(graph))

    monkeypatch.setattr(PostGradPassManager, "__call__", spy)
    tails: list[int] = []

    def recorded_launch(x, weight, config=None, **kwargs):
        tails.append(x.shape[0])
        return launch_gemv(x, weight, config, **kwargs)

    monkeypatch.setattr(fp8_linear_norm, "launch_gemv", recorded_launch)
    monkeypatch.setenv("PIECEWORKS_SMALL_M_GEMV", "1")
    eager_tokens, eager_logits = greedy_decode(num_tokens=4, level=0, quantization="fp8")
    compilation = {
        "backend": "inductor",
        "pass_config": {"enable_fusion": True},
        "inductor_compile_config": {"fx_graph_cache": False},  # the passes must really run
    }
    tokens, logits = greedy_decode(4, level=3, quantization="fp8", compilation_config=compilation)
    folded = [counts["pieceworks.small_m_fp8_linear_add_rms_norm.default"] for counts in after]
    fused = [counts["pieceworks.fused_add_rms_norm_static_fp8_quant.default"] for counts in after]
    assert (folded, fused) == ([0, 2, 1], [0, 0, 0])
    # Each decode step (3 tokens) runs the 3 folded norms as tails; the prefill (29 tokens) runs
    # the two ops. On a GPU the captured graphs replay what was launched during capture.
    assert tails and all(num_tokens == 3 for num_tokens in tails)
    if not ON_GPU:
        assert len(tails) == 3 * 3
    assert tokens == eager_tokens
    tolerance = 5e-3 if ON_GPU else 1e-4  # GPU: cuBLAS and the FP8 MMA each round their sums
    for actual, expected in zip(logits, eager_logits, strict=True):
        torch.testing.assert_close(actual, expected, rtol=tolerance, atol=tolerance)
