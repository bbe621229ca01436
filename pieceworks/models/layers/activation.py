"""The activations of the MLPs: the gated ``SiluAndMul`` (Llama-style) and ``GeluAndMul`` (Gemma's
GeGLU) on a merged gate/up projection, and ``ReLUSquared``, the ungated ``relu2`` of Nemotron-H.

Input ``(num_tokens, 2 * d)``, output ``(num_tokens, d)``: ``act(x[..., :d]) * x[..., d:]``. The
engine's chooser decides each layer's form once, when the model is built (vLLM's ``custom_ops``;
``KernelChooser.uses_op_form``, through ``choose_kernels``): where it gives the op
(``silu_and_mul``, ``gelu_and_mul``) a kernel, the layer calls pieceworks' op
(``pieceworks::silu_and_mul``, ``kernels/activation/triton_silu_and_mul.py``, which the gate/up
GEMV fusion pass, ``core/passes/gemv_fusion.py``, folds into the GEMV before it;
``pieceworks::gelu_and_mul``, ``kernels/activation/triton_gelu_and_mul.py``); elsewhere it is the
plain ATen form (``kernels/activation/torch_activation.py``), which Inductor fuses with its
neighbours. Eager and compiled calls run the same form. ``HF_GELU_APPROXIMATE`` maps the
transformers activation names pieceworks implements with ``GeluAndMul`` to its ``approximate``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from pieceworks.kernels.activation.torch_activation import (
    GELU_APPROXIMATIONS,
    gelu_and_mul,
    silu_and_mul,
)
from pieceworks.kernels.activation.triton_gelu_and_mul import gelu_and_mul_op
from pieceworks.kernels.activation.triton_silu_and_mul import silu_and_mul_op
from pieceworks.kernels.chooser import KernelChooser

__all__ = [
    "HF_GELU_APPROXIMATE",
    "GeluAndMul",
    "ReLUSquared",
    "SiluAndMul",
    "gelu_and_mul",
    "silu_and_mul",
]

# transformers' ACT2FN name -> torch's gelu ``approximate`` (``gelu`` is the erf form)
HF_GELU_APPROXIMATE = {"gelu_pytorch_tanh": "tanh", "gelu": "none"}


class SiluAndMul(nn.Module):
    """``silu(gate) * up`` for ``x = [gate, up] (T, 2d)``: the op or the torch form, as chosen."""

    def __init__(self) -> None:
        super().__init__()
        # an out-of-tree platform's silu_and_mul(x), where it registered one
        self.kernel: Callable[..., torch.Tensor] | None = None
        self.uses_op = False  # the torch form until the engine's chooser says otherwise

    def choose_kernels(self, kernels: KernelChooser) -> None:
        """Take this layer's form from the engine's chooser (once, when the model is built)."""
        self.kernel = kernels.choose("silu_and_mul").impl.fn
        self.uses_op = kernels.uses_op_form("silu_and_mul")
        if self.uses_op:  # registered before Dynamo traces the first call, which uses the handle
            self.op = silu_and_mul_op()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:
            return self.kernel(x)
        if self.uses_op and x.dim() == 2:
            return self.op(x)  # (T, d)
        return silu_and_mul(x)  # (T, d)


class GeluAndMul(nn.Module):
    """``gelu(gate, approximate) * up`` for ``x = [gate, up] (T, 2d)``: the op or the torch form,
    as chosen. ``approximate``: ``"tanh"`` (HF's ``gelu_pytorch_tanh``) or ``"none"`` (erf)."""

    def __init__(self, approximate: str = "tanh") -> None:
        super().__init__()
        if approximate not in GELU_APPROXIMATIONS:
            raise ValueError(
                f"GeluAndMul: approximate={approximate!r} is not supported; supported: "
                f"{', '.join(GELU_APPROXIMATIONS)}"
            )
        self.approximate = approximate
        # an out-of-tree platform's gelu_and_mul(x, approximate), where it registered one
        self.kernel: Callable[..., torch.Tensor] | None = None
        self.uses_op = False  # the torch form until the engine's chooser says otherwise

    def choose_kernels(self, kernels: KernelChooser) -> None:
        """Take this layer's form from the engine's chooser (once, when the model is built)."""
        self.kernel = kernels.choose("gelu_and_mul").impl.fn
        self.uses_op = kernels.uses_op_form("gelu_and_mul")
        if self.uses_op:  # registered before Dynamo traces the first call, which uses the handle
            self.op = gelu_and_mul_op()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:
            return self.kernel(x, self.approximate)
        if self.uses_op and x.dim() == 2:
            return self.op(x, self.approximate)  # (T, d)
        return gelu_and_mul(x, self.approximate)  # (T, d)

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}"


class ReLUSquared(nn.Module):
    """``relu(x) ** 2`` (transformers' ``relu2``, Nemotron-H's MLP): plain ATen, fused by
    Inductor with its neighbours."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.square(torch.relu(x))  # (T, d)
