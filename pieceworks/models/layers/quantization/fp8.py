"""FP8 (e4m3) linear layers with static per-tensor scales (``quantization="fp8"``).

Weights are loaded in the model dtype and quantized once, after loading, to the platform's FP8
format (``core.norm_quant.fp8_dtype()``: ``float8_e4m3fn``, max 448, on NVIDIA and the CPU;
``float8_e4m3fnuz``, max 240, on AMD MI300) with one scale per weight tensor: ``weight_scale =
max|W| / fp8_max`` (a merged ``qkv_proj`` or ``gate_up_proj`` gets one scale for the whole merged
tensor). Activations are quantized on every call with a static scale ``input_scale`` (see
``docs/passes.md``, "FP8", for the rule: ``FP8_STATIC_INPUT_SCALE``, values saturate at
+-fp8_max * scale). pieceworks' Triton FP8 kernels take e4m3fn only: on a device of another
format every FP8 product takes ``fp8_gemm``. The GEMM is ``torch._scaled_mm``
where the platform's device capability has ``fp8_gemm``, else the torch reference: dequantize both
operands to float32, multiply, scale, cast back. Both read the same FP8 tensors, so the CPU
reference computes what the GPU computes up to float32 accumulation order.

The activation quantization is ``core.norm_quant.static_scaled_fp8_quant`` in plain ATen: Inductor
fuses it into whatever produced the activation, and where that is an RMSNorm the fusion pass
(``core/passes/fusion.py``) replaces the pair with one fused op.

Where the engine's chooser turns the small-M GEMV on (``choose_kernels``), the GEMM is the op
``pieceworks::small_m_fp8_linear`` (the FP8 ops and ``fp8_gemm`` are registered beside their
kernels, in ``kernels/gemv/small_m_fp8.py``): the Triton GEMV on FP8 operands for at most 16
tokens (64 for a weight of at most 12 MiB; ``kernels/gemv/triton_gemv.py``), ``fp8_gemm`` above
that. On Hopper,
products whose weight slices mostly fit in shared memory (the attention's ``o_proj`` and
``qkv_proj`` at 8B widths) take the resident-weight GEMV instead, which copies its weights before it
waits for the kernel before (``kernels/gemv/resident_gemv.py``). In compiled graphs the fusion
passes (``core/passes/gemv_fusion.py``) make the MLP's gate/up projection
``pieceworks::small_m_fp8_silu_and_mul``: the GEMV with ``silu(gate) * up`` and the down
projection's static quantization as its epilogue, so it hands ``down_proj`` FP8 values and the
activation costs no kernel of its own; and the attention's qkv projection
``pieceworks::small_m_fp8_rope_linear``: the GEMV with the rotary embedding of the q and k heads as
its epilogue (``kernels/gemv/triton_gemv_rope.py``; the resident GEMV's rotary form where it
applies). ``apply`` takes an input that is already FP8 as quantized with the layer's own
``input_scale``.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from pieceworks.core.norm_quant import fp8_dtype, fp8_max, static_scaled_fp8_quant
from pieceworks.kernels.chooser import KernelChooser
from pieceworks.kernels.gemv.small_m_fp8 import (
    fp8_gemm,
    register_small_m_fp8_ops,
    small_m_fp8_rope_linear_op,
)
from pieceworks.kernels.norm_quant.norm_quant_ops import register_norm_quant_ops
from pieceworks.models.layers.quantization.base import LinearMethod, layer_tensor
from pieceworks.platforms.capability import FP8_GEMM

# The static activation scale of every FP8 linear layer (see the module docstring).
FP8_STATIC_INPUT_SCALE = 1.0


@dataclasses.dataclass(frozen=True)
class Fp8Config:
    """``quantization="fp8"``: per-tensor e4m3 weights quantized at load, static input scale."""

    input_scale: float = FP8_STATIC_INPUT_SCALE

    def get_linear_method(self) -> Fp8LinearMethod:
        return Fp8LinearMethod(self)


def quantize_weight_per_tensor(
    weight: torch.Tensor, dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(W_fp8, scale)`` with ``W ~= W_fp8 * scale`` and ``scale = max|W| / fp8_max(dtype)``
    (0-d, fp32) in ``dtype`` (default: the platform's FP8 format)."""
    dtype = dtype or fp8_dtype()
    amax = weight.abs().max().to(torch.float32)
    scale = torch.clamp(amax, min=torch.finfo(torch.float32).tiny) / fp8_max(dtype)
    return static_scaled_fp8_quant(weight, scale, dtype), scale


def output_dtype(layer: nn.Module) -> torch.dtype:
    """The dtype an FP8 layer's GEMM returns: its weight's dtype before quantization."""
    dtype = getattr(layer, "output_dtype", None)  # set by process_weights_after_loading
    assert isinstance(dtype, torch.dtype), f"{type(layer).__name__}.output_dtype is not a dtype"
    return dtype


class Fp8LinearMethod(LinearMethod):
    """Quantizes the layer's weight after loading; quantizes its input and runs an FP8 GEMM."""

    def __init__(self, config: Fp8Config) -> None:
        self.config = config
        self.fp8_dtype = fp8_dtype()  # the device's e4m3 flavour
        self.native = False  # decided after loading, when the weights are on their device
        register_norm_quant_ops()  # the fusion pass replaces RMSNorm -> quant with these

    def choose_kernels(self, kernels: KernelChooser) -> None:
        self.small_m_gemv = kernels.small_m_gemv_enabled("fp8_linear", self.fp8_dtype)
        if self.small_m_gemv:  # forward calls the handles it keeps, never the registration
            self.small_m_linear, _ = register_small_m_fp8_ops()
            small_m_fp8_rope_linear_op()

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        from pieceworks.platforms import current_platform

        loaded = layer_tensor(layer, "weight").detach()
        weight, weight_scale = quantize_weight_per_tensor(loaded, self.fp8_dtype)
        vars(layer)["output_dtype"] = loaded.dtype  # the model dtype: what the GEMM returns
        layer.weight = nn.Parameter(weight, requires_grad=False)  # (out, in) self.fp8_dtype
        layer.weight_scale = nn.Parameter(weight_scale, requires_grad=False)
        input_scale = torch.tensor(self.config.input_scale, dtype=torch.float32)
        layer.input_scale = nn.Parameter(input_scale.to(weight.device), requires_grad=False)
        self.native = current_platform().device_capability().has(FP8_GEMM)

    def quantized_operands(
        self, layer: nn.Module, x: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(x_fp8, weight, input_scale, weight_scale)`` with x as 2-D (T, in)."""
        weight, input_scale = layer_tensor(layer, "weight"), layer_tensor(layer, "input_scale")
        if weight.dtype != self.fp8_dtype:
            raise RuntimeError(
                f"{getattr(layer, 'prefix', 'linear')}: FP8 weights not processed; the loader "
                "calls process_weights_after_loading after loading the checkpoint"
            )
        x_2d = x.reshape(-1, x.shape[-1])  # (T, in): the GEMM is 2-D
        # an FP8 input was quantized with this layer's scale (a fused epilogue before it)
        if x.dtype == self.fp8_dtype:
            x_fp8 = x_2d
        else:
            x_fp8 = static_scaled_fp8_quant(x_2d, input_scale, self.fp8_dtype)
        return x_fp8, weight, input_scale, layer_tensor(layer, "weight_scale")

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        x_fp8, weight, input_scale, weight_scale = self.quantized_operands(layer, x)
        out_dtype = output_dtype(layer)
        if self.in_graph():
            args = (x_fp8, weight, input_scale, weight_scale, bias, out_dtype, self.native)
            output = self.small_m_linear(*args)
        else:
            output = fp8_gemm(
                x_fp8, weight, input_scale, weight_scale, out_dtype, bias, self.native
            )
        return output.reshape(*x.shape[:-1], output.shape[-1])  # (T, out)
