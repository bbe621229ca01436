"""``silu_and_mul`` (and the module ``SiluAndMul``): the gated activation of Llama-style MLPs,
on a merged gate/up projection.

Plain ATen so Inductor fuses it with its neighbours; input ``(num_tokens, 2 * d)``, output
``(num_tokens, d)``. The Llama MLP hands it to its down projection
(``RowParallelLinear(..., silu_and_mul_input=True)``), so a linear method can compute it inside
its GEMM (the small-M GEMV does).
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
        return silu_and_mul(x)
