"""``RMSNorm`` and ``GemmaRMSNorm``: root-mean-square normalisation, with vLLM's fused
residual-add form.

Plain ATen, so Inductor fuses the add, the reduction and the scale into one kernel. The arithmetic
is ``core.norm_quant.rms_norm`` / ``add_rms_norm`` / ``gemma_rms_norm``: the fusion passes in
``core/passes`` (FP8, and the q/k head norms' into the qkv GEMV) match exactly what those functions
trace to, so the layer calls them rather than repeating
them. Where an out-of-tree platform registered its own ``rms_norm`` (``kernels/chooser.py``), the
layer calls that instead, chosen when the model is built (``choose_kernels``). ``GemmaRMSNorm``
is Gemma's: the checkpoint stores ``weight - 1`` and the scale ``1 + weight`` multiplies in float32
before the cast back (transformers' ``Gemma3RMSNorm``); it is always its torch form (the platform
kernel and the FP8 fusion pass take ``weight * x``). Activations are flattened tokens:
``(num_tokens, hidden_size)``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from pieceworks.core.norm_quant import add_rms_norm, gemma_rms_norm, rms_norm
from pieceworks.kernels.chooser import KernelChooser


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x**2) + eps)``, computed in float32 and cast back.

    ``forward(x)`` returns ``norm(x)``; ``forward(x, residual)`` returns
    ``(norm(x + residual), x + residual)``, so a decoder layer carries the residual stream
    without a separate add.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.variance_epsilon = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        # an out-of-tree platform's rms_norm(x, weight, eps), where it registered one
        self.kernel: Callable[..., torch.Tensor] | None = None

    def choose_kernels(self, kernels: KernelChooser) -> None:
        """Take this layer's form from the engine's chooser (once, when the model is built)."""
        self.kernel = kernels.choose("rms_norm").impl.fn

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if self.kernel is not None:
            if residual is None:
                return self.kernel(x, self.weight, self.variance_epsilon)
            x = x + residual
            return self.kernel(x, self.weight, self.variance_epsilon), x
        if residual is None:
            return rms_norm(x, self.weight, self.variance_epsilon)  # (T, hidden)
        return add_rms_norm(x, residual, self.weight, self.variance_epsilon)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.variance_epsilon}"


class GemmaRMSNorm(nn.Module):
    """Gemma's ``(1 + weight) * x / sqrt(mean(x**2) + eps)`` (a zero weight is the identity
    scale), computed in float32 and cast back.

    ``forward(x)`` returns ``norm(x)``; ``forward(x, residual)`` returns
    ``(norm(x + residual), x + residual)``, the sum in the activations' dtype, as transformers
    adds the residual stream.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.variance_epsilon = eps
        self.weight = nn.Parameter(torch.zeros(hidden_size), requires_grad=False)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return gemma_rms_norm(x, self.weight, self.variance_epsilon)  # (T, hidden)
        x = x + residual
        return gemma_rms_norm(x, self.weight, self.variance_epsilon), x

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.variance_epsilon}"
