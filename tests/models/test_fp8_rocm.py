"""FP8 on an AMD MI300 (gfx942), on paper: the CPU platform with a fake MI300 capability.

Proves that the FP8 format comes from the device family: on gfx94x, weights are quantized to
``float8_e4m3fnuz`` with ``weight_scale = max|W| / 240`` (so the largest quantized magnitude is
exactly 240), activations saturate at +-240, and the Triton FP8 kernels (which store e4m3fn) are
passed over: the chooser gives ``fp8_linear`` ``torch._scaled_mm``, the fused norm + quant ops
are the torch references, and the attention quant fusion leaves the quantization to ``o_proj``
(the attention kernels write e4m3fn). Llama-tiny
with ``quantization="fp8"`` then runs through the engine with logits within FP8's error of the
unquantized model's (the bound of ``tests/models/test_fp8.py``: e4m3fnuz has e4m3fn's 3 mantissa
bits). The engine run drops ``fp8_gemm`` from the fake capability: this CPU's ``torch._scaled_mm``
does not take e4m3fnuz, which an MI300 runs through hipBLASLt.
Run: PYTHONPATH=. PIECEWORKS_PLATFORM=cpu python -m pytest tests/models/test_fp8_rocm.py -q
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pieceworks import platforms
from pieceworks.core.decorators import piecewise_backends
from pieceworks.core.norm_quant import fp8_dtype, fp8_max, static_scaled_fp8_quant
from pieceworks.kernels.chooser import KernelChooser
from pieceworks.models.layers.quantization.fp8 import Fp8LinearMethod, quantize_weight_per_tensor
from pieceworks.platforms.capability import FP8_GEMM, amd_capability
from pieceworks.platforms.cpu import CpuPlatform
from pieceworks.sampling_params import SamplingParams
from tests.models.test_fp8 import MAX_RELATIVE_RMS_ERROR, prefill_logits, relative_rms

MI300 = amd_capability("gfx942:sramecc+:xnack-", num_compute_units=304)
FNUZ = torch.float8_e4m3fnuz


class FakeMi300Platform(CpuPlatform):
    """The CPU platform answering an MI300's capability (without native FP8 GEMMs: see above)."""

    def _probe_capability(self):
        return dataclasses.replace(MI300, features=MI300.features - {FP8_GEMM})


@pytest.fixture
def fake_mi300(monkeypatch):
    monkeypatch.setattr(platforms, "_current", FakeMi300Platform())
    yield


def test_mi300_family_converts_e4m3fnuz_and_later_amd_e4m3fn():
    assert MI300.fp8_dtype == FNUZ and MI300.has(FP8_GEMM)
    assert amd_capability("gfx950").fp8_dtype == torch.float8_e4m3fn
    assert fp8_max(FNUZ) == 240.0 and fp8_max(torch.float8_e4m3fn) == 448.0


def test_the_chooser_gives_fp8_linear_scaled_mm_on_mi300():
    choice = KernelChooser("rocm", MI300).choose("fp8_linear", dtype=MI300.fp8_dtype)
    assert choice.impl.name == "scaled_mm"
    passed = dict(choice.passed_over)
    assert passed["hopper_resident_gemv"] == "for nvidia devices, not amd"
    assert passed["triton_gemv"] == "does not take float8_e4m3fnuz"


def test_weights_and_activations_quantize_to_e4m3fnuz(fake_mi300):
    assert fp8_dtype() == FNUZ
    torch.manual_seed(0)
    weight = torch.randn(32, 64) * 0.05
    quantized, scale = quantize_weight_per_tensor(weight)
    assert quantized.dtype == FNUZ
    torch.testing.assert_close(scale, weight.abs().max() / 240.0, rtol=0, atol=0)
    assert float(quantized.float().abs().max()) == 240.0  # max|W| / scale, exactly representable
    dequantized = quantized.float() * scale
    assert relative_rms(dequantized, weight) < 2**-4  # e4m3: 3 mantissa bits
    saturated = static_scaled_fp8_quant(torch.tensor([1000.0, -1000.0, 1.0]), torch.tensor(1.0))
    assert saturated.dtype == FNUZ and saturated.float().tolist() == [240.0, -240.0, 1.0]


def test_llama_fp8_on_mi300_quantizes_to_e4m3fnuz_and_stays_close(fake_mi300):
    fp8 = prefill_logits("fp8", {"level": 0})
    from pieceworks.engine.llm import LLM

    llm = LLM("llama-tiny", compilation_config={"level": 0}, dtype="float32", max_num_seqs=4,
              quantization="fp8")  # fmt: skip
    model = llm.engine.runner.model
    fp8_layers = [m for m in model.modules() if isinstance(getattr(m, "quant_method", None),
                                                            Fp8LinearMethod)]  # fmt: skip
    assert len(fp8_layers) == 2 * 4  # llama-tiny: 2 layers x qkv, o, gate_up, down
    for layer in fp8_layers:
        assert layer.weight.dtype == FNUZ, layer.prefix
        assert float(layer.weight.float().abs().max()) == 240.0, layer.prefix
    chosen = llm.engine.runner.kernels.chosen_kernels()
    assert chosen["fp8_linear"].impl.name == "torch"  # no e4m3fn kernels
    compiled = LLM("llama-tiny", compilation_config={"level": 3, "backend": "eager"},
                   dtype="float32", max_num_seqs=4, quantization="fp8")  # fmt: skip
    compiled.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=2))
    (backend,) = piecewise_backends(compiled.engine.runner.model)
    assert backend.num_fusions["attn_quant"] == 0  # e4m3fnuz: o_proj quantizes its own input
    platforms._current = CpuPlatform()  # the unquantized reference on the plain CPU
    reference = prefill_logits(None, {"level": 0})
    error = relative_rms(fp8, reference)
    assert 1e-3 < error < MAX_RELATIVE_RMS_ERROR  # really quantized, and not broken
