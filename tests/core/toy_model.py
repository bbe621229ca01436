"""A toy model around a registered "silly" split op, for exact tests of the compile pipeline.

``silly::attention(q, k, v, out)`` writes ``q + k + v`` into ``out`` and bumps a Python counter each
time it really runs, so a test can prove the op ran outside the graph during replay.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.library import Library

from pieceworks.config import EngineConfig
from pieceworks.core.custom_op import direct_register_custom_op
from pieceworks.core.decorators import support_torch_compile

SILLY_OP = "silly::attention"
silly_lib = Library("silly", "FRAGMENT")
silly_calls = {"count": 0}


def _silly_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> None:
    silly_calls["count"] += 1
    out.copy_(q + k + v)


def _silly_attention_fake(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor
) -> None:
    return None


def silly_attention_op():
    """Register on first use (registration resolves the platform's dispatch key)."""
    return direct_register_custom_op(
        "attention",
        _silly_attention,
        mutates_args=["out"],
        fake_impl=_silly_attention_fake,
        target_lib=silly_lib,
    )


@support_torch_compile
class ToyModel(nn.Module):
    """``num_layers`` blocks of: linear, silly attention (split point), scale-and-add."""

    def __init__(
        self,
        *,
        config: EngineConfig,
        prefix: str = "",
        num_layers: int = 2,
        hidden_size: int = 8,
        identity: bool = False,
    ) -> None:
        super().__init__()
        self.attention = silly_attention_op()
        self.layers = nn.ModuleList(
            nn.Linear(hidden_size, hidden_size, bias=False) for _ in range(num_layers)
        )
        if identity:
            for layer in self.layers:
                nn.init.eye_(layer.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
            out = torch.empty_like(x)
            self.attention(x, x, x, out)
            x = out * 0.5 + x
        return x * 2.0


@support_torch_compile
class ShapeBranchModel(nn.Module):
    """Its output depends on a Python branch on the token count: shows whether guards run."""

    def __init__(self, *, config: EngineConfig, prefix: str = "") -> None:
        super().__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > 4:
            return x + 100.0
        return x - 100.0
