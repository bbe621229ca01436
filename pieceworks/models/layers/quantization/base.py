"""``LinearMethod``: what a linear layer delegates to its quantization, and the plain version.

A method owns the layer's GEMM (``apply``) and the one-time rewrite of its loaded weights
(``process_weights_after_loading``, called by the loader after every checkpoint tensor landed).
Layers keep a method instance each; methods keep no per-layer state of their own beyond flags.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def layer_tensor(layer: nn.Module, name: str) -> torch.Tensor:
    """``layer.<name>`` (a parameter the method owns), typed as a tensor."""
    value = getattr(layer, name)
    assert isinstance(value, torch.Tensor), f"{name} of {type(layer).__name__} is not a tensor"
    return value


class LinearMethod:
    """Interface: ``apply(layer, x, bias) -> y`` and ``process_weights_after_loading(layer)``."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Rewrite ``layer``'s parameters once the checkpoint is loaded (default: nothing)."""

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError


class UnquantizedLinearMethod(LinearMethod):
    """``y = x W^T (+ b)`` in the model dtype."""

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, layer_tensor(layer, "weight"), bias)  # (T, out)
