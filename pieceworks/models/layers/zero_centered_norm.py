"""``ZeroCenteredRMSNorm``: RMSNorm whose weight is stored as an offset from one.

``x / sqrt(mean(x**2) + eps) * (1 + weight)``, all in float32, cast back at the end
(transformers' ``Qwen3_5RMSNorm``: checkpoints hold ``weight`` near zero). The offset is applied
in float32 at every call rather than folded into the weight at load time, so a bfloat16 model
keeps the precision of ``1 + weight`` as transformers does. Plain ATen, fused by Inductor; with
``residual`` it is the fused residual-add form of ``RMSNorm``.
"""

from __future__ import annotations

import torch
from torch import nn


class ZeroCenteredRMSNorm(nn.Module):
    """``forward(x)`` -> ``norm(x)``; ``forward(x, residual)`` -> ``(norm(x + residual),
    x + residual)``. Activations ``(..., hidden_size)``."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.hidden_size, self.variance_epsilon = hidden_size, eps
        self.weight = nn.Parameter(torch.zeros(hidden_size), requires_grad=False)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is not None:
            x = x + residual
        x_float = x.float()
        normed = x_float * torch.rsqrt(
            x_float.pow(2).mean(-1, keepdim=True) + self.variance_epsilon
        )
        out = (normed * (1.0 + self.weight.float())).to(x.dtype)
        return out if residual is None else (out, x)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.variance_epsilon}"
