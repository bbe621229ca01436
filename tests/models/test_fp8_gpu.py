"""FP8 on a GPU (H200): native GEMM, the fused Triton kernel, Llama and the 8B shape end to end.

They check that the device capability has ``fp8_gemm`` on Hopper, that ``torch._scaled_mm`` agrees
with the dequantizing reference GEMM, that the fused RMSNorm (+ residual) + FP8 quant Triton kernel
gives the torch reference's bytes at 8B widths, and that Llama with ``quantization="fp8"`` and the
fusion pass runs FULL_AND_PIECEWISE through the engine: within FP8's error of the bf16 model at two
layers of the 8B widths (the CPU bound), and, at full depth, close to the same FP8 weights run
through the reference GEMM at level 0 (see the bounds below for why full-depth FP8-vs-bf16 is
loose). Each test prints what it measured.
Run on a GPU machine: pytest -m gpu tests/models/test_fp8_gpu.py -s
"""

from __future__ import annotations

import dataclasses
import gc

import pytest
import torch

from pieceworks.benchmarks.modes import compilation_for_mode
from pieceworks.core.norm_quant import (
    KERNEL_FP8_DTYPE,
    fused_add_rms_norm_static_fp8_quant_reference,
    rms_norm_static_fp8_quant_reference,
)
from pieceworks.engine.llm import LLM
from pieceworks.models.layers.quantization.fp8 import fp8_gemm, quantize_weight_per_tensor
from pieceworks.models.loading.presets import get_preset, random_hf_checkpoint
from pieceworks.platforms import current_platform
from pieceworks.platforms.capability import FP8_GEMM
from pieceworks.sampling_params import SamplingParams
from tests.models.test_fp8 import (
    assert_fp8_close,
    record_logits,
    relative_rms,
)

pytestmark = pytest.mark.gpu
# Measured on the H200 on 2026-11-30 (random-weight models, static input scale 1.0):
# - FP8 vs bf16 at two layers of the 8B widths: 0.162 (the float32 CPU reference path of the same
#   two-layer model gives 0.154, so this is FP8 at these widths, not the GPU path; llama-tiny's
#   4 % (MAX_RELATIVE_RMS_ERROR) holds only at its small widths). Bound: 0.25.
# - Deeper, any perturbation is amplified: 0.137 at 12 layers (125m), 0.54 at 32 (8B); unrelated
#   logits would give sqrt(2) ~ 1.41, so the deep bounds say "still the same function".
# - The same FP8 weights through the native path (scaled_mm, fused norm+quant, graphs) and the
#   reference GEMM at level 0: 0.34 at 32 layers, 0.083 at two layers. Both at level 0, so that
#   only the GEMM differs: 0.075 at two layers. That is the GEMM's own 7e-4 after FP8 amplifies
#   it: a 7e-4 perturbation of every GEMM output of this two-layer model, on the CPU, moved its
#   logits by 0.079 (bf16 model: 0.0084), in a one-off run of the method that
#   tests/models/test_fp8.py::test_fp8_amplifies_gemm_rounding_differences runs at 1024 wide.
#   A wrong scale or layout gives ~1. Bounds: 0.5 at 32 layers, 0.12 at two.
MAX_RELATIVE_RMS_ERROR_8B_WIDTHS = 0.25
MAX_RELATIVE_RMS_ERROR_125M = 0.3
MAX_RELATIVE_RMS_ERROR_8B = 0.9
MAX_NATIVE_VS_REFERENCE_8B = 0.5
MAX_NATIVE_VS_REFERENCE_2_LAYERS = 0.12
MAX_GEMM_ONLY_2_LAYERS = 0.12


def device() -> torch.device:
    return current_platform().device()


def without_fp8_gemm(monkeypatch) -> None:
    """The platform's device, for the rest of the test, runs no FP8 GEMM natively."""
    platform = current_platform()
    capability = platform.device_capability()
    features = capability.features - {FP8_GEMM}
    reference = dataclasses.replace(capability, features=features)
    monkeypatch.setattr(type(platform), "device_capability", lambda self: reference)


def test_hopper_runs_fp8_natively():
    assert current_platform().device_capability().has(FP8_GEMM)


@pytest.mark.parametrize("num_tokens", [1, 7, 256])
def test_scaled_mm_matches_reference_gemm(num_tokens):
    generator = torch.Generator(device=device()).manual_seed(0)
    x = torch.randn(num_tokens, 4096, device=device(), generator=generator)
    weight, weight_scale = quantize_weight_per_tensor(
        torch.randn(6144, 4096, device=device(), generator=generator) * 0.02
    )
    input_scale = torch.tensor(1.0, device=device())
    x_fp8 = x.clamp(-448, 448).to(KERNEL_FP8_DTYPE)
    args = (x_fp8, weight, input_scale, weight_scale, torch.bfloat16, None)
    native, reference = fp8_gemm(*args, native=True), fp8_gemm(*args, native=False)
    print(f"scaled_mm vs reference, {num_tokens} tokens: {relative_rms(native, reference):.2e}")
    torch.testing.assert_close(native, reference, rtol=1.6e-2, atol=1e-2)  # bf16 output


@pytest.mark.parametrize("num_tokens", [1, 7, 256])
@pytest.mark.parametrize("with_residual", [False, True])
def test_triton_fused_kernel_matches_reference_at_8b_width(num_tokens, with_residual):
    from pieceworks.kernels.norm_quant import triton_norm_quant

    generator = torch.Generator(device=device()).manual_seed(0)
    shape = (num_tokens, 4096)
    x = torch.randn(shape, device=device(), generator=generator).bfloat16()
    residual = torch.randn(shape, device=device(), generator=generator).bfloat16()
    weight = (1 + 0.1 * torch.randn(4096, device=device(), generator=generator)).bfloat16()
    scale = torch.tensor(0.02, device=device())
    result, expected = (
        torch.empty(shape, dtype=KERNEL_FP8_DTYPE, device=device()) for _ in range(2)
    )
    if with_residual:
        residual_out, expected_residual = torch.empty_like(x), torch.empty_like(x)
        triton_norm_quant.fused_add_rms_norm_static_fp8_quant(
            result, residual_out, x, residual, weight, scale, 1e-5
        )
        fused_add_rms_norm_static_fp8_quant_reference(
            expected, expected_residual, x, residual, weight, scale, 1e-5
        )
        torch.testing.assert_close(residual_out, expected_residual, rtol=0, atol=0)
    else:
        triton_norm_quant.rms_norm_static_fp8_quant(result, x, weight, scale, 1e-5)
        rms_norm_static_fp8_quant_reference(expected, x, weight, scale, 1e-5)
    mismatched = (result.view(torch.uint8) != expected.view(torch.uint8)).float().mean()
    print(f"fused kernel, {num_tokens} tokens, residual={with_residual}: {mismatched:.2%} off")
    assert_fp8_close(result, expected)


def prefill_logits(
    model: str,
    quantization: str | None,
    prompts: list[list[int]],
    mode: str = "full_and_piecewise",
):
    """Last-token logits of each prompt through the engine (fusion on for FP8 when compiled)."""
    compilation = compilation_for_mode(
        mode, {"pass_config": {"enable_fusion": quantization == "fp8"}}
    )
    llm = LLM(
        model,
        compilation_config=compilation,
        dtype="bfloat16",
        max_num_seqs=8,
        quantization=quantization,
    )
    runner_model = llm.engine.runner.model
    recorded = record_logits(runner_model)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    tokens = [out.outputs[0].token_ids for out in llm.generate(prompts, params)]
    weight_bytes = sum(p.numel() * p.element_size() for p in runner_model.parameters())
    del llm, runner_model
    gc.collect()
    current_platform().empty_cache()
    return recorded[0], tokens, weight_bytes


def prompts_for(vocab_size: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab_size, (n,), generator=generator).tolist() for n in (3, 17)]


def fp8_against_bf16(model: str, vocab_size: int) -> float:
    prompts = prompts_for(vocab_size)
    reference, reference_tokens, bf16_bytes = prefill_logits(model, None, prompts)
    fp8, fp8_tokens, fp8_bytes = prefill_logits(model, "fp8", prompts)
    error = relative_rms(fp8.float(), reference.float())
    print(
        f"{model} fp8 vs bf16: relative RMS {error:.4f}, weights {fp8_bytes / 2**30:.2f} GiB "
        f"vs {bf16_bytes / 2**30:.2f} GiB; tokens {fp8_tokens} vs {reference_tokens}"
    )
    assert fp8_bytes < 0.75 * bf16_bytes  # the decoder linears are half the bytes
    return error


def test_fp8_at_8b_widths_two_layers(tmp_path):
    """The 8B GEMM and norm widths at a depth where FP8 error is not yet amplified."""
    hf_config = get_preset("llama-3.1-8b")
    hf_config.update(num_hidden_layers=2, vocab_size=32000)
    random_hf_checkpoint(hf_config, tmp_path, dtype=torch.bfloat16)
    error = fp8_against_bf16(str(tmp_path), 32000)
    assert 1e-3 < error < MAX_RELATIVE_RMS_ERROR_8B_WIDTHS


def test_fp8_native_matches_reference_path_at_two_layers(tmp_path, monkeypatch):
    """The same FP8 weights three ways: native compiled (scaled_mm, fused norm+quant, graphs),
    native eager (scaled_mm, unfused), reference eager (the dequantizing torch GEMM). Eager native
    vs reference differ in the GEMM alone; compiled vs eager in Inductor's roundings and the
    fused kernel, which move some activations across an e4m3 rounding boundary."""
    hf_config = get_preset("llama-3.1-8b")
    hf_config.update(num_hidden_layers=2, vocab_size=32000)
    random_hf_checkpoint(hf_config, tmp_path, dtype=torch.bfloat16)
    prompts = prompts_for(32000)
    compiled, _, _ = prefill_logits(str(tmp_path), "fp8", prompts)
    eager, _, _ = prefill_logits(str(tmp_path), "fp8", prompts, "eager")
    without_fp8_gemm(monkeypatch)
    reference, _, _ = prefill_logits(str(tmp_path), "fp8", prompts, "eager")
    gemm_only = relative_rms(eager.float(), reference.float())
    end_to_end = relative_rms(compiled.float(), reference.float())
    print(
        f"two layers at 8B widths, fp8: native eager vs reference eager {gemm_only:.4f}, "
        f"native compiled vs reference eager {end_to_end:.4f}, "
        f"native compiled vs native eager {relative_rms(compiled.float(), eager.float()):.4f}"
    )
    assert gemm_only < MAX_GEMM_ONLY_2_LAYERS
    assert end_to_end < MAX_NATIVE_VS_REFERENCE_2_LAYERS


def test_llama_125m_fp8_full_and_piecewise():
    error = fp8_against_bf16("llama-125m", 50272)
    assert 1e-3 < error < MAX_RELATIVE_RMS_ERROR_125M


def test_llama_8b_shape_fp8_native_matches_reference_path(monkeypatch):
    """FULL_AND_PIECEWISE FP8 (scaled_mm, fused Triton norm+quant, graphs) against the same FP8
    weights through the dequantizing torch GEMM at level 0, and FP8 against bf16 (reported)."""
    prompts = prompts_for(128256)
    error_to_bf16 = fp8_against_bf16("llama-3.1-8b", 128256)
    assert error_to_bf16 < MAX_RELATIVE_RMS_ERROR_8B
    native, native_tokens, _ = prefill_logits("llama-3.1-8b", "fp8", prompts)
    without_fp8_gemm(monkeypatch)
    reference, reference_tokens, _ = prefill_logits("llama-3.1-8b", "fp8", prompts, "eager")
    error = relative_rms(native.float(), reference.float())
    print(
        f"llama-3.1-8b fp8 native compiled vs fp8 reference eager: relative RMS {error:.4f}; "
        f"tokens {native_tokens} vs {reference_tokens}"
    )
    assert error < MAX_NATIVE_VS_REFERENCE_8B
