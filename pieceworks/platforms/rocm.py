"""The ROCm platform (AMD): HIP Graphs and RCCL through the same ``torch.cuda`` API as CUDA.

A ROCm build of torch reports ``torch.version.hip`` and exposes HIP devices as ``cuda``; graphs,
pools, the dispatch key and the distributed backend name are shared with ``CudaPlatform``. Only
detection, naming, FP8 support and the NVIDIA-only launch and MMA features differ, so that is all
this class overrides.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from pieceworks.platforms.capability import DeviceCapability, amd_capability
from pieceworks.platforms.cuda import CudaPlatform, device_facts
from pieceworks.platforms.interface import Platform


class RocmPlatform(CudaPlatform):
    """AMD GPUs through torch's HIP build. ``dist_backend`` "nccl" is RCCL there."""

    name: ClassVar[str] = "rocm"
    # MI300 (gfx94x) converts e4m3fnuz; later AMD devices OCP e4m3fn.
    fp8_formats: ClassVar[tuple[torch.dtype, ...]] = (torch.float8_e4m3fnuz, torch.float8_e4m3fn)

    @classmethod
    def is_available(cls) -> bool:
        return torch.version.hip is not None and torch.cuda.is_available()

    def unavailable_reason(self) -> str:
        if torch.version.hip is None:
            return "this torch build is not a ROCm (HIP) build"
        return "torch.cuda.is_available() is False (no visible AMD device or driver)"

    def prepare_kernel_compiler(self, cache_dir: str | None) -> dict[str, str]:
        """Triton's cache directory only: NVIDIA's ``ptxas`` has no part on AMD devices."""
        return Platform.prepare_kernel_compiler(self, cache_dir)

    def _probe_capability(self) -> DeviceCapability:
        properties = torch.cuda.get_device_properties()
        arch_name = getattr(properties, "gcnArchName", "unknown")
        return amd_capability(arch_name, **device_facts(properties))

    def device_name(self) -> str:
        properties = torch.cuda.get_device_properties()
        return f"{properties.name} ({getattr(properties, 'gcnArchName', 'unknown arch')})"
