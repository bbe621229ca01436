"""Quantized linear layers: how a ``LinearBase`` stores its weight and runs its GEMM.

A linear layer delegates both to its ``quant_method`` (vLLM's split): ``UnquantizedLinearMethod``
(``base.py``) or, with ``quantization="fp8"``, ``Fp8LinearMethod`` (``fp8.py``). The loader copies
checkpoint tensors into the layer as usual, then calls ``process_weights_after_loading`` on every
method, where FP8 quantizes the weight. The fused RMSNorm + FP8 quant ops that the fusion pass
emits are registered beside their kernel, in ``kernels/norm_quant/norm_quant_ops.py``; the FP8
GEMM ops in ``kernels/gemv/small_m_fp8.py``. Each method takes its kernels from the engine's
chooser when the model is built (``choose_kernels``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pieceworks.models.layers.quantization.base import LinearMethod, UnquantizedLinearMethod
from pieceworks.models.layers.quantization.fp8 import Fp8Config, Fp8LinearMethod

if TYPE_CHECKING:
    from pieceworks.config import ModelConfig


def get_quant_config(model_config: ModelConfig) -> Fp8Config | None:
    """The quantization config ``model_config.quantization`` names (None: unquantized)."""
    return Fp8Config() if model_config.quantization == "fp8" else None


__all__ = [
    "Fp8Config",
    "Fp8LinearMethod",
    "LinearMethod",
    "UnquantizedLinearMethod",
    "get_quant_config",
]
