"""FP8 (e4m3) linear layers with static per-tensor scales (``quantization="fp8"``).

Weights are loaded in the model dtype and quantized once, after loading, to ``float8_e4m3fn``
with one scale per weight tensor: ``weight_scale = max|W| / 448`` (a merged ``qkv_proj`` or
``gate_up_proj`` gets one scale for the whole merged tensor). Activations are quantized on every
call with a static scale ``input_scale`` (see ``docs/passes.md``, "FP8", for the rule:
``FP8_STATIC_INPUT_SCALE``, values saturate at +-448 * scale). The GEMM is ``torch._scaled_mm``
where ``current_platform().supports_fp8()``, else the torch reference: dequantize both operands
to float32, multiply, scale, cast back. Both read the same FP8 tensors, so the CPU reference
computes what the GPU computes up to float32 accumulation order.

The activation quantization is ``core.norm_quant.static_scaled_fp8_quant`` in plain ATen: Inductor
fuses it into whatever produced the activation, and where that is an RMSNorm the fusion pass
(``core/passes/fusion.py``) replaces the pair with one fused op.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from pieceworks.core.norm_quant import FP8_DTYPE, FP8_MAX, static_scaled_fp8_quant
from pieceworks.models.layers.quantization.base import LinearMethod, layer_tensor

# The static activation scale of every FP8 linear layer (see the module docstring).
FP8_STATIC_INPUT_SCALE = 1.0


@dataclasses.dataclass(frozen=True)
class Fp8Config:
    """``quantization="fp8"``: per-tensor e4m3 weights quantized at load, static input scale."""

    input_scale: float = FP8_STATIC_INPUT_SCALE

    def get_linear_method(self) -> Fp8LinearMethod:
        return Fp8LinearMethod(self)


def quantize_weight_per_tensor(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(W_fp8, scale)`` with ``W ~= W_fp8 * scale`` and ``scale = max|W| / 448`` (0-d, fp32)."""
    amax = weight.abs().max().to(torch.float32)
    scale = torch.clamp(amax, min=torch.finfo(torch.float32).tiny) / FP8_MAX
    return static_scaled_fp8_quant(weight, scale), scale


def fp8_gemm(
    x_fp8: torch.Tensor,
    weight: torch.Tensor,
    input_scale: torch.Tensor,
    weight_scale: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None,
    native: bool,
) -> torch.Tensor:
    """``(x_fp8 * input_scale) @ (weight * weight_scale)^T + bias`` in ``out_dtype``; x is 2-D."""
    if native:
        # weight is (out, in) row-major, so weight.t() is the column-major operand cuBLAS wants.
        return torch._scaled_mm(
            x_fp8,
            weight.t(),
            scale_a=input_scale,
            scale_b=weight_scale,
            bias=bias,
            out_dtype=out_dtype,
        )
    output = torch.mm(x_fp8.to(torch.float32), weight.to(torch.float32).t())  # (T, out)
    output = (output * (input_scale * weight_scale)).to(out_dtype)
    return output if bias is None else output + bias


class Fp8LinearMethod(LinearMethod):
    """Quantizes the layer's weight after loading; quantizes its input and runs an FP8 GEMM."""

    def __init__(self, config: Fp8Config) -> None:
        from pieceworks.models.layers.quantization.norm_quant_ops import register_norm_quant_ops

        self.config = config
        self.native = False  # decided after loading, when the weights are on their device
        register_norm_quant_ops()  # the fusion pass replaces RMSNorm -> quant with these

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        from pieceworks.platforms import current_platform

        weight, weight_scale = quantize_weight_per_tensor(layer_tensor(layer, "weight").detach())
        layer.weight = nn.Parameter(weight, requires_grad=False)  # (out, in) float8_e4m3fn
        layer.weight_scale = nn.Parameter(weight_scale, requires_grad=False)
        input_scale = torch.tensor(self.config.input_scale, dtype=torch.float32)
        layer.input_scale = nn.Parameter(input_scale.to(weight.device), requires_grad=False)
        self.native = current_platform().supports_fp8()

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        weight, input_scale = layer_tensor(layer, "weight"), layer_tensor(layer, "input_scale")
        if weight.dtype != FP8_DTYPE:
            raise RuntimeError(
                f"{getattr(layer, 'prefix', 'linear')}: FP8 weights not processed; the loader "
                "calls process_weights_after_loading after loading the checkpoint"
            )
        x_2d = x.reshape(-1, x.shape[-1])  # (T, in): the GEMM is 2-D
        x_fp8 = static_scaled_fp8_quant(x_2d, input_scale)
        weight_scale = layer_tensor(layer, "weight_scale")
        output = fp8_gemm(x_fp8, weight, input_scale, weight_scale, x.dtype, bias, self.native)
        return output.reshape(*x.shape[:-1], output.shape[-1])  # (T, out)
