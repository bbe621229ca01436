"""``silu_and_mul``: the gated activation of Llama-style MLPs, on a merged gate/up projection.

Plain ATen so Inductor fuses it with its neighbours; input ``(num_tokens, 2 * d)``, output
``(num_tokens, d)``. The MLP reaches it through ``LinearMethod.apply_silu_and_mul``, which in
compiled decode graphs runs it as the gate/up GEMV's epilogue instead (``triton_gemv.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :d]) * x[..., d:]`` where ``d = x.shape[-1] // 2`` (gate first, then up)."""
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]  # (T, d)
