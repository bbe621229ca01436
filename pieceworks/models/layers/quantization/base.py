"""``LinearMethod``: what a linear layer delegates to its quantization, and the plain version.

A method owns the layer's GEMM (``apply``) and the one-time rewrite of its loaded weights
(``process_weights_after_loading``, called by the loader after every checkpoint tensor landed).
Layers keep a method instance each; methods keep no per-layer state of their own beyond flags.
In compiled graphs the unquantized GEMM goes through ``pieceworks::small_m_linear``
(``layers/triton_gemv.py``), a Triton GEMV for <= 16 tokens, where the platform runs pieceworks'
Triton kernels (``PIECEWORKS_SMALL_M_GEMV`` overrides this, read when the method is built). Eager
calls keep ``F.linear``: the op's dispatch and the Triton launch cost more host time than a
cuBLAS call, and only a captured graph hides host time. ``apply_silu_and_mul`` is the MLP's
gate/up projection followed by its activation; in compiled graphs it is one GEMV whose epilogue
computes the activation (``pieceworks::small_m_silu_and_mul_linear``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pieceworks import envs
from pieceworks.models.layers.activation import silu_and_mul
from pieceworks.models.layers.triton_gemv import (
    small_m_linear_op,
    small_m_silu_and_mul_linear_op,
)
from pieceworks.platforms import current_platform


def layer_tensor(layer: nn.Module, name: str) -> torch.Tensor:
    """``layer.<name>`` (a parameter the method owns), typed as a tensor."""
    value = getattr(layer, name)
    assert isinstance(value, torch.Tensor), f"{name} of {type(layer).__name__} is not a tensor"
    return value


def small_m_gemv_enabled() -> bool:
    """Whether compiled graphs route decode-sized GEMMs to the Triton GEMV: where the platform
    runs pieceworks' Triton kernels, unless ``PIECEWORKS_SMALL_M_GEMV`` says otherwise."""
    choice = envs.PIECEWORKS_SMALL_M_GEMV
    return current_platform().runs_triton_kernels() if choice is None else choice


class LinearMethod:
    """Interface: ``apply(layer, x, bias) -> y`` and ``process_weights_after_loading(layer)``."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Rewrite ``layer``'s parameters once the checkpoint is loaded (default: nothing)."""

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError

    def apply_silu_and_mul(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None, consumer: nn.Module
    ) -> torch.Tensor:
        """``silu_and_mul(apply(layer, x, bias))`` for a merged [gate; up] layer, as an input
        that ``consumer`` (the next linear layer) takes; a method may return it in the form
        ``consumer``'s method wants (FP8: already quantized)."""
        return silu_and_mul(self.apply(layer, x, bias))  # (T, I)


class UnquantizedLinearMethod(LinearMethod):
    """``y = x W^T (+ b)`` in the model dtype: ``F.linear``, or in compiled graphs the GEMV op."""

    def __init__(self) -> None:
        self.small_m_gemv = small_m_gemv_enabled()
        if self.small_m_gemv:  # registered before Dynamo traces the first call
            small_m_linear_op()
            small_m_silu_and_mul_linear_op()

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        weight = layer_tensor(layer, "weight")
        if not (self.small_m_gemv and torch.compiler.is_compiling()):
            return F.linear(x, weight, bias)  # (T, out)
        output = small_m_linear_op()(x.reshape(-1, x.shape[-1]), weight, bias)  # (T, out)
        return output.reshape(*x.shape[:-1], output.shape[-1])

    def apply_silu_and_mul(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None, consumer: nn.Module
    ) -> torch.Tensor:
        if bias is not None or not (self.small_m_gemv and torch.compiler.is_compiling()):
            return super().apply_silu_and_mul(layer, x, bias, consumer)
        weight = layer_tensor(layer, "weight")
        output = small_m_silu_and_mul_linear_op()(x.reshape(-1, x.shape[-1]), weight)  # (T, I)
        return output.reshape(*x.shape[:-1], output.shape[-1])
