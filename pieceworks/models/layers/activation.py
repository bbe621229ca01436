"""``SiluAndMul``: the gated activation of Llama-style MLPs, on a merged gate/up projection; and
``ReLUSquared``, the ungated ``relu2`` of Nemotron-H's MLP.

Input ``(num_tokens, 2 * d)``, output ``(num_tokens, d)``: ``silu(x[..., :d]) * x[..., d:]``. The
engine's chooser decides its form once, when the model is built (vLLM's ``custom_ops``;
``KernelChooser.uses_op_form``, through ``choose_kernels``): where it gives ``silu_and_mul`` a
kernel, the layer calls the op ``pieceworks::silu_and_mul``
(``kernels/activation/triton_silu_and_mul.py``), which the gate/up GEMV fusion pass
(``core/passes/gemv_fusion.py``) folds into the GEMV before it; elsewhere it is the plain ATen
form (``kernels/activation/torch_activation.py``), which Inductor fuses with its neighbours.
Eager and compiled calls run the same form.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from pieceworks.kernels.activation.torch_activation import silu_and_mul
from pieceworks.kernels.activation.triton_silu_and_mul import silu_and_mul_op
from pieceworks.kernels.chooser import KernelChooser

__all__ = ["ReLUSquared", "SiluAndMul", "silu_and_mul"]


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


class ReLUSquared(nn.Module):
    """``relu(x) ** 2`` (transformers' ``relu2``, Nemotron-H's MLP): plain ATen, fused by
    Inductor with its neighbours."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.square(torch.relu(x))  # (T, d)
