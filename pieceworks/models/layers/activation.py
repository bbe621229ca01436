"""``SiluAndMul``: the gated activation of Llama-style MLPs, on a merged gate/up projection.

Plain ATen so Inductor fuses it with its neighbours; input ``(num_tokens, 2 * d)``, output
``(num_tokens, d)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :d]) * x[..., d:]`` where ``d = x.shape[-1] // 2`` (gate first, then up)."""
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]  # (T, d)


class SiluAndMul(nn.Module):
    """``silu_and_mul`` as a module."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x)  # (T, d)
