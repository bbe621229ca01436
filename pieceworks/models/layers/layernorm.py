"""``RMSNorm``: root-mean-square normalisation, with vLLM's fused residual-add form.

Plain ATen, so Inductor fuses the add, the reduction and the scale into one kernel. The arithmetic
is ``core.norm_quant.rms_norm`` / ``add_rms_norm``: the FP8 fusion pass in ``core/passes``
pattern-matches exactly what those functions trace to, so the layer calls them rather than
repeating them. Activations are flattened tokens: ``(num_tokens, hidden_size)``.
"""

from __future__ import annotations

import torch
from torch import nn

from pieceworks.core.norm_quant import add_rms_norm, rms_norm


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

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return rms_norm(x, self.weight, self.variance_epsilon)  # (T, hidden)
        return add_rms_norm(x, residual, self.weight, self.variance_epsilon)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.variance_epsilon}"
