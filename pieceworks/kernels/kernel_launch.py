"""``KernelLaunch``: one Triton kernel launch with everything but its tensor arguments bound.

A launch's grid, strides, sizes, constexprs and warp counts follow from shapes alone, and working
them out (plus the shape checks) costs more host time than the launch itself. A caller that sees
the same shapes again (the attention layer once per shape signature, the argmax once per logits
shape) builds a ``KernelLaunch`` once and then passes only the tensors, which may be different
tensors on every call as long as they have the shapes and strides the launch was built from.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from pieceworks.kernels import precompile
from pieceworks.kernels.bound_launch import BoundKernel, bind, launch_hooks_set
from pieceworks.kernels.triton_device import INTERPRETED
from pieceworks.kernels.triton_launch import launch


@dataclasses.dataclass(frozen=True)
class KernelLaunch:
    """``kernel[grid](*tensors, *scalars, **options)``: the kernel's tensors come first.

    The first launch's compiled binary is bound (``kernels/bound_launch.py``): later calls whose
    tensors it accepts launch it directly, without Triton's per-call argument binding."""

    kernel: Any  # a @triton.jit function
    grid: tuple[int, ...]
    scalars: tuple[int | float, ...]  # the arguments after the tensors: scales, strides, sizes
    options: dict[str, Any]  # constexprs and launch options (num_warps, num_stages)
    # The bound binary once a launch compiled it (a one-item list: the dataclass is frozen).
    bound: list[BoundKernel | None] = dataclasses.field(
        default_factory=lambda: [None], compare=False, repr=False
    )

    def __call__(self, *tensors: torch.Tensor) -> None:
        bound = self.bound[0]
        if bound is not None and bound.accepts(tensors) and not launch_hooks_set():
            if not precompile.is_active():  # a dry run launches nothing
                bound(tensors)
            return
        compiled = launch(self.kernel, self.grid, *tensors, *self.scalars, **self.options)
        if bound is None and compiled is not None and not INTERPRETED:
            self.bound[0] = bind(
                self.kernel, compiled, self.grid, tensors, self.scalars, self.options
            )
