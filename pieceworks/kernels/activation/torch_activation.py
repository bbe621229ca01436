"""``silu_and_mul`` in torch: the gated activation of Llama-style MLPs on a merged gate/up product.

Plain ATen so Inductor fuses it with its neighbours; input ``(num_tokens, 2 * d)``, output
``(num_tokens, d)``. The MLP layer calls it (``models/layers/activation.py``), and the Triton
epilogue kernel (``triton_silu_and_mul.py``) falls back to it where it does not run.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :d]) * x[..., d:]`` where ``d = x.shape[-1] // 2`` (gate first, then up)."""
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]  # (T, d)
