"""The simgraph platform's own kernel: an RMSNorm op registered through pieceworks' vendor seam.

A real vendor would launch its device's kernel here; the example computes RMSNorm in torch as
``simgraph::rms_norm`` (a ``torch.library`` custom op, so Dynamo traces it as one opaque call and
a compiled graph runs it as such) and counts its calls, so a test can see that the chooser picked
it and that eager and compiled models ran it. ``register_kernels`` is the one call a vendor makes:
``pieceworks.kernels.register_kernel(op, impl, name=..., platform=...)``.
"""

from __future__ import annotations

import torch

from pieceworks.kernels import register_kernel

PLATFORM_NAME = "simgraph"
calls = {"rms_norm": 0}  # calls that ran (eager or inside a compiled graph)


@torch.library.custom_op("simgraph::rms_norm", mutates_args=())
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * x / sqrt(mean(x**2) + eps)`` in float32, cast back before ``weight``
    (the arithmetic of ``pieceworks.core.norm_quant.rms_norm``)."""
    calls["rms_norm"] += 1
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)
    return x32.to(x.dtype) * weight


@rms_norm.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.empty_like(x)


def register_kernels() -> None:
    """Register the platform's implementations with pieceworks' chooser (idempotent)."""
    register_kernel("rms_norm", rms_norm, name="simgraph_rms_norm", platform=PLATFORM_NAME)
