"""``LinearMethod``: what a linear layer delegates to its quantization, and the plain version.

A method owns the layer's GEMM (``apply``) and the one-time rewrite of its loaded weights
(``process_weights_after_loading``, called by the loader after every checkpoint tensor landed).
Layers keep a method instance each; methods keep no per-layer state of their own beyond flags.
The unquantized GEMM goes through ``pieceworks::small_m_linear``
(``kernels/gemv/triton_gemv.py``), a Triton GEMV for <= 16 tokens (<= 64 for a weight of at
most 12 MiB, ``max_gemv_tokens``), where the engine's kernel chooser picks
the GEMV for the platform (``kernels/chooser.py``; ``PIECEWORKS_SMALL_M_GEMV`` overrides this),
and an out-of-tree platform's own ``linear`` where it registered one. The choice is made once,
when the model is built (``choose_kernels``, called by the loader; until then a method runs the
torch form), so eager (level 0) and compiled calls run the same ops and eager is an oracle for
compiled numerics. The fused forms (the gate/up GEMV with the
activation as its epilogue, ``pieceworks::small_m_silu_and_mul_linear`` and
``small_m_gelu_and_mul_linear``; the qkv GEMV with the rotary as its epilogue,
``pieceworks::small_m_rope_linear``, and after q/k head norms,
``pieceworks::small_m_qk_norm_rope_linear``) are registered here, when the GEMV
ops are on, and put into compiled graphs by the fusion passes (``core/passes/gemv_fusion.py``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pieceworks.kernels.chooser import KernelChooser
from pieceworks.kernels.gemv.triton_gemv import (
    small_m_gelu_and_mul_linear_op,
    small_m_linear_op,
    small_m_silu_and_mul_linear_op,
)
from pieceworks.kernels.gemv.triton_gemv_qk_norm_rope import small_m_qk_norm_rope_linear_op
from pieceworks.kernels.gemv.triton_gemv_rope import small_m_rope_linear_op


def layer_tensor(layer: nn.Module, name: str) -> torch.Tensor:
    """``layer.<name>`` (a parameter the method owns), typed as a tensor."""
    value = getattr(layer, name)
    assert isinstance(value, torch.Tensor), f"{name} of {type(layer).__name__} is not a tensor"
    return value


class LinearMethod:
    """Interface: ``choose_kernels(kernels)``, ``apply(layer, x, bias) -> y`` and
    ``process_weights_after_loading(layer)``."""

    small_m_gemv = False  # methods that route decode-sized GEMMs to the GEMV ops set it
    kernel: Callable[..., torch.Tensor] | None = None  # an out-of-tree linear, if one was chosen

    def in_graph(self) -> bool:
        """Whether this layer's GEMMs go through the GEMV ops (decided when it was built; eager
        and compiled calls run the same ops)."""
        return self.small_m_gemv

    def choose_kernels(self, kernels: KernelChooser) -> None:
        """Take this layer's GEMM from the engine's chooser (default: the torch form)."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Rewrite ``layer``'s parameters once the checkpoint is loaded (default: nothing)."""

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError


class UnquantizedLinearMethod(LinearMethod):
    """``y = x W^T (+ b)`` in the model dtype: ``F.linear``, the GEMV op, or the platform's own
    ``linear``, as the chooser decided when the method was built."""

    def choose_kernels(self, kernels: KernelChooser) -> None:
        self.kernel = kernels.choose("linear").impl.fn  # set where a platform registered its own
        self.small_m_gemv = self.kernel is None and kernels.small_m_gemv_enabled()
        # registered before Dynamo traces the first call; forward calls the handle it keeps
        if self.small_m_gemv:
            self.small_m_linear = small_m_linear_op()
            small_m_silu_and_mul_linear_op()
            small_m_gelu_and_mul_linear_op()
            small_m_rope_linear_op()
            small_m_qk_norm_rope_linear_op()

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        weight = layer_tensor(layer, "weight")
        if self.kernel is not None:
            return self.kernel(x, weight, bias)  # (T, out)
        if not self.in_graph():
            return F.linear(x, weight, bias)  # (T, out)
        output = self.small_m_linear(x.reshape(-1, x.shape[-1]), weight, bias)  # (T, out)
        return output.reshape(*x.shape[:-1], output.shape[-1])
