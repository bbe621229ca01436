"""``RMSNorm``: root-mean-square normalisation, with vLLM's fused residual-add form.

Plain ATen, so Inductor fuses the add, the reduction and the scale into one kernel; the FP8 fusion
pass in ``core/passes`` pattern-matches this exact sequence. Activations are flattened tokens:
``(num_tokens, hidden_size)``.
"""

from __future__ import annotations

import torch
from torch import nn


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
        orig_dtype = x.dtype
        x = x.to(torch.float32)  # (T, hidden)
        if residual is not None:
            x = x + residual.to(torch.float32)
            residual = x.to(orig_dtype)
        variance = x.pow(2).mean(dim=-1, keepdim=True)  # (T, 1)
        x = x * torch.rsqrt(variance + self.variance_epsilon)
        x = x.to(orig_dtype) * self.weight
        return x if residual is None else (x, residual)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.variance_epsilon}"
