"""Where pieceworks' Triton kernels run: on the platform's device, compiled or interpreted.

``INTERPRETED``: Triton's interpreter runs every kernel (``TRITON_INTERPRET=1``, how the kernel
tests run on the CPU). ``kernel_runs_on(x)``: the platform runs pieceworks' Triton kernels and
``x`` lives on its device; ``compiled_kernels_run_on(device)``: the same, compiled rather than
interpreted (what launch options, precompiling and the GPU's properties apply to). Read by the
launchers of every family, by ``triton_launch.py`` and by ``precompile.py``; it launches nothing.
"""

from __future__ import annotations

import torch

from pieceworks.kernels.nvidia_pdl import pdl_start
from pieceworks.platforms import current_platform
from pieceworks.platforms.capability import TRITON

INTERPRETED = type(pdl_start).__name__ == "InterpretedFunction"  # TRITON_INTERPRET=1


def kernel_runs_on(x: torch.Tensor) -> bool:
    """Whether ``x`` lives on the platform's device and the platform runs pieceworks' Triton
    kernels (CUDA, ROCm)."""
    return _platform_runs_kernels_on(x.device)


def compiled_kernels_run_on(device: torch.device) -> bool:
    """Whether pieceworks' Triton kernels run compiled (not interpreted) on ``device``: the
    platform runs them and ``device`` is the platform's; what launch options and the GPU's
    properties (``triton_gemv_config``) apply to."""
    return not INTERPRETED and _platform_runs_kernels_on(device)


def _platform_runs_kernels_on(device: torch.device) -> bool:
    platform = current_platform()
    return platform.device_capability().has(TRITON) and device.type == platform.device_type
