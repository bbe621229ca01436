"""The FP8 GEMV with the fused add + RMSNorm + quant as its prologue (``fp8_norm_linear.py``).

Proves that (1) ``small_m_fp8_add_rms_norm_linear`` on the kernel path (each GEMV program
normalising and quantizing the row itself) gives what the two ops it replaces give, the fused
norm + quant and then the GEMV with the same epilogue, for each epilogue (plain, SiLU-and-mul with
FP8 output, rotary), 1, 5 and 16 tokens, bfloat16 and float32 activations, and stores the
residual sum; (2) past 16 tokens, or where the kernel does not run, it runs those two ops, with
the same values; (3) a wrong epilogue name or norm operands that do not fit are refused with a
ValueError. The pass that emits the op: ``tests/core/passes/test_gemv_norm_fold.py``.

What runs where: as in ``test_triton_gemv.py``; on CPU the kernel runs interpreted
(``triton_launch.kernel_runs_on`` patched) and the results are byte-identical. On a GPU the
prologue's mean square is summed in another order than the reference's, so a normalised value
may round to the neighbouring bfloat16 (and FP8) value: there the comparison allows that.
Run: TRITON_INTERPRET=1 python -m pytest -q tests/models/test_fp8_norm_linear.py -p no:cacheprovider
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernel below is decorated

from pieceworks.core.norm_quant import FP8_DTYPE, add_rms_norm, static_scaled_fp8_quant  # noqa: E402
from pieceworks.models.layers import triton_launch  # noqa: E402
from pieceworks.models.layers.quantization import fp8_norm_linear  # noqa: E402
from pieceworks.models.layers.quantization.fp8 import quantize_weight_per_tensor  # noqa: E402
from pieceworks.models.layers.quantization.norm_quant_ops import (  # noqa: E402
    register_norm_quant_ops,
)
from pieceworks.models.layers.triton_gemv import NormPrologue, launch_gemv  # noqa: E402
from pieceworks.models.layers.triton_gemv_rope import rope_epilogue  # noqa: E402
from tests.models.test_triton_gemv import DEVICE, INTERPRETED, requires_triton  # noqa: E402

EPS = 1e-5
HIDDEN, HEAD_SIZE, NUM_HEADS = 256, 32, 3  # rope: 3 heads (q, k, v), the first 2 rotated


@pytest.fixture(autouse=True)
def _fused_norm_op():
    register_norm_quant_ops()  # the fallback path calls it


def operands(num_tokens: int, dtype: torch.dtype, epilogue: str):
    generator = torch.Generator().manual_seed(num_tokens)
    x = torch.randn(num_tokens, HIDDEN, generator=generator).to(DEVICE, dtype)
    residual = torch.randn(num_tokens, HIDDEN, generator=generator).to(DEVICE, dtype)
    norm_weight = (1 + 0.1 * torch.randn(HIDDEN, generator=generator)).to(DEVICE, dtype)
    out_rows = {"linear": 96, "silu_and_mul": 128, "rope": NUM_HEADS * HEAD_SIZE}[epilogue]
    full = torch.randn(out_rows, HIDDEN, generator=generator) / HIDDEN**0.5
    weight, weight_scale = quantize_weight_per_tensor(full.to(DEVICE, dtype))
    positions = torch.randint(0, 64, (num_tokens,), generator=generator).to(DEVICE)
    angles = torch.arange(64)[:, None] * torch.linspace(0.05, 1.0, HEAD_SIZE // 2)[None, :]
    cos_sin_cache = torch.cat([angles.cos(), angles.sin()], dim=1).to(DEVICE, dtype)
    return dict(
        input=x,
        residual=residual,
        norm_weight=norm_weight,
        epsilon=EPS,
        weight=weight,
        input_scale=torch.tensor(0.02, device=DEVICE),
        weight_scale=weight_scale,
        epilogue=epilogue,
        bias=None,
        out_scale=torch.tensor(0.01, device=DEVICE) if epilogue == "silu_and_mul" else None,
        positions=positions if epilogue == "rope" else None,
        cos_sin_cache=cos_sin_cache if epilogue == "rope" else None,
        head_size=HEAD_SIZE,
        num_rotary_heads=2,
        out_dtype=dtype,
        native=False,
    )


def unfolded(args: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The two ops the folded one replaces: fused add + norm + quant, then the GEMV kernel."""
    normed, residual_out = add_rms_norm(
        args["input"], args["residual"], args["norm_weight"], args["epsilon"]
    )
    x_fp8 = static_scaled_fp8_quant(normed, args["input_scale"])
    rope = None
    if args["epilogue"] == "rope":
        rope = rope_epilogue(args["positions"], args["cos_sin_cache"], HEAD_SIZE, 2)
    output = launch_gemv(
        x_fp8,
        args["weight"],
        scales=(args["input_scale"], args["weight_scale"]),
        gated=args["epilogue"] == "silu_and_mul",
        rope=rope,
        out_dtype=args["out_dtype"],
        out_scale=args["out_scale"],
    )
    return output, residual_out


def assert_matches(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    if INTERPRETED:
        assert torch.equal(actual.view(torch.uint8), expected.view(torch.uint8))
    else:  # a neighbouring rounding of a normalised value moves an output by a fraction of it
        rtol = 2**-3 if actual.dtype == FP8_DTYPE else 2**-6
        torch.testing.assert_close(actual.float(), expected.float(), rtol=rtol, atol=1e-2)


@requires_triton
@pytest.mark.parametrize("epilogue", fp8_norm_linear.EPILOGUES)
@pytest.mark.parametrize("num_tokens", [1, 5, 16])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernel_prologue_equals_norm_then_gemv(monkeypatch, epilogue, num_tokens, dtype):
    monkeypatch.setattr(triton_launch, "kernel_runs_on", lambda x: True)
    launches: list[NormPrologue | None] = []

    def recorded_launch(x, weight, config=None, **kwargs):
        launches.append(kwargs.get("norm"))
        return launch_gemv(x, weight, config, **kwargs)

    monkeypatch.setattr(fp8_norm_linear, "launch_gemv", recorded_launch)
    args = operands(num_tokens, dtype, epilogue)
    output, residual_out = fp8_norm_linear.small_m_fp8_add_rms_norm_linear(**args)
    assert len(launches) == 1 and launches[0] is not None  # one launch, with the prologue
    expected_output, expected_residual = unfolded(args)
    assert torch.equal(residual_out, expected_residual)
    assert_matches(output, expected_output)


@requires_triton
@pytest.mark.parametrize("epilogue", fp8_norm_linear.EPILOGUES)
def test_fallback_runs_the_two_ops(monkeypatch, epilogue):
    args = operands(17, torch.bfloat16, epilogue)  # past MAX_GEMV_TOKENS: no prologue kernel
    monkeypatch.setattr(triton_launch, "kernel_runs_on", lambda x: True)
    assert not fp8_norm_linear.uses_norm_kernel(
        args["input"], args["residual"], args["weight"], epilogue, args["cos_sin_cache"],
        HEAD_SIZE, torch.bfloat16,
    )  # fmt: skip
    output, residual_out = fp8_norm_linear.small_m_fp8_add_rms_norm_linear(**args)
    expected_output, expected_residual = unfolded(args)  # 17 tokens fit the kernel directly
    assert torch.equal(residual_out, expected_residual)
    # The fallback GEMM is fp8_gemm's float32 matmul, not the kernel: the same FP8 operands, so
    # the results differ only by where they round (bfloat16, or e4m3 after SiLU-and-mul).
    assert output.dtype == expected_output.dtype and output.shape == expected_output.shape
    # e4m3 steps are 2^-3 relative, and 2^-9 apart at the smallest values
    rtol, atol = (2**-3, 1e-2) if output.dtype == FP8_DTYPE else (2**-7, 2e-3)
    torch.testing.assert_close(output.float(), expected_output.float(), rtol=rtol, atol=atol)


def test_wrong_epilogue_or_operands_are_refused():
    args = operands(1, torch.float32, "linear")
    with pytest.raises(ValueError, match="epilogue 'gelu'"):
        fp8_norm_linear.small_m_fp8_add_rms_norm_linear(**{**args, "epilogue": "gelu"})
    norm = NormPrologue(args["input"], None, args["norm_weight"][:-1], EPS, None)  # (K - 1,)
    with pytest.raises(ValueError, match="norm weight"):
        launch_gemv(None, args["weight"], scales=(args["input_scale"], args["weight_scale"]),
                    out_dtype=torch.float32, norm=norm)  # fmt: skip
    with pytest.raises(ValueError, match="either x or norm"):
        launch_gemv(args["input"], args["weight"], out_dtype=torch.float32, norm=norm)
