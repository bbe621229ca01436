"""How pieceworks' decode kernels are launched: programmatic dependent launch (PDL).

Under PDL (``kernels/programmatic_launch.py`` decides where) a kernel may be scheduled while the
kernel before it on the stream still runs, and waits inside until that kernel has finished and
its writes are visible; only then does it read its inputs or write anything. What comes before
the wait overlaps the previous kernel: the launch and the kernel's set-up. Most kernels open
with ``pdl_start``, which also lets the kernel after them be scheduled at once. The GEMV waits
before its K loop and lets the next kernel be scheduled after it (``triton_gemv.py``): programs
scheduled early would take the SMs that its later waves need. A GEMV of one wave with SMs to
spare (the 8B ``down_proj``) and the rotary qkv GEMV release at their start instead
(``triton_gemv.releases_at_start``). The kernels that take part: the GEMV, the fused RMSNorm +
FP8 quant, decode attention's split and reduce (and Inductor's, through its own switch). Some
read, before their wait, what no kernel still running can write: the resident-weight GEMV copies
its weights (``resident_gemv.py``), and decode attention's split kernel loads its metadata and
first K/V tile before it waits for q. Every kernel here also reads its parameters there (FP8
scales, the norm weight) and the GEMVs the rotary factors at the step's positions, so no load
round trip follows the wait or the K loop. The contract this needs: such operands are parameters,
constant buffers or the step inputs the runner copies before the step; never the output of a
kernel of the step.
"""

from __future__ import annotations

from typing import Any

import torch

from pieceworks.kernels import precompile, triton_device
from pieceworks.kernels.nvidia_pdl import pdl_start
from pieceworks.kernels.programmatic_launch import programmatic_launch_enabled

__all__ = ["launch", "launch_options", "pdl_start", "programmatic_launch"]


def launch(kernel: Any, grid: Any, *args: Any, **options: Any) -> Any:
    """``kernel[grid](*args, **options)``: every pieceworks kernel launches through here. Inside
    ``precompile.precompiling`` it queues the kernel's compile instead and runs nothing (None);
    else it returns what Triton's launch returns (the compiled kernel)."""
    if precompile.is_active():
        precompile.queue(kernel, grid, args, options)
        return None
    return kernel[grid](*args, **options)


def programmatic_launch(device: torch.device) -> bool:
    """Whether kernels on ``device`` are launched with PDL: where the process uses it and the
    kernels run compiled there (``triton_device.compiled_kernels_run_on``)."""
    return triton_device.compiled_kernels_run_on(device) and programmatic_launch_enabled()


def launch_options(pdl: bool) -> dict[str, Any]:
    """The Triton launch options that go with a kernel's ``PDL`` constexpr."""
    return {"launch_pdl": True} if pdl else {}
