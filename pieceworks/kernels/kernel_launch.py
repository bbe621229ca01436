"""``KernelLaunch``: one Triton kernel launch with everything but its tensor arguments bound.

A launch's grid, strides, sizes, constexprs and warp counts follow from shapes alone, and working
them out (plus the shape checks) costs more host time than the launch itself. A caller that sees
the same shapes again (the attention layer, once per shape signature) builds a ``KernelLaunch``
once and then passes only the tensors, which may be different tensors on every call as long as
they have the shapes and strides the launch was built from.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch


@dataclasses.dataclass(frozen=True)
class KernelLaunch:
    """``kernel[grid](*tensors, *scalars, **options)``: the kernel's tensors come first."""

    kernel: Any  # a @triton.jit function
    grid: tuple[int, ...]
    scalars: tuple[int | float, ...]  # the arguments after the tensors: scales, strides, sizes
    options: dict[str, Any]  # constexprs and launch options (num_warps, num_stages)

    def __call__(self, *tensors: torch.Tensor) -> None:
        self.kernel[self.grid](*tensors, *self.scalars, **self.options)
