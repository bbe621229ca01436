"""The gated activations in torch: ``silu_and_mul`` (Llama-style MLPs) and ``gelu_and_mul``
(Gemma's GeGLU), each on a merged gate/up product.

Plain ATen so Inductor fuses them with their neighbours; input ``(num_tokens, 2 * d)``, output
``(num_tokens, d)``. The MLP layers call them (``models/layers/activation.py``), and the Triton
kernels (``triton_silu_and_mul.py``, ``triton_gelu_and_mul.py``) fall back to them where they do
not run.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

GELU_APPROXIMATIONS = ("none", "tanh")  # torch.nn.functional.gelu's ``approximate``


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :d]) * x[..., d:]`` where ``d = x.shape[-1] // 2`` (gate first, then up)."""
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]  # (T, d)


def gelu_and_mul(x: torch.Tensor, approximate: str = "tanh") -> torch.Tensor:
    """``gelu(x[..., :d], approximate) * x[..., d:]`` where ``d = x.shape[-1] // 2``: the erf
    form (``"none"``) or the tanh approximation (``"tanh"``, HF's ``gelu_pytorch_tanh``)."""
    d = x.shape[-1] // 2
    return F.gelu(x[..., :d], approximate=approximate) * x[..., d:]  # (T, d)
