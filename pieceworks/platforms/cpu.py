"""The CPU platform: no static graphs, torch reference kernels, gloo for distributed runs."""

from __future__ import annotations

from typing import ClassVar

from pieceworks.platforms.capability import CPU_CAPABILITY, DeviceCapability
from pieceworks.platforms.interface import Platform


class CpuPlatform(Platform):
    """Always available; runs every model eagerly or Inductor-compiled, without graph capture."""

    name: ClassVar[str] = "cpu"
    device_type: ClassVar[str] = "cpu"
    dispatch_key: ClassVar[str] = "CPU"
    dist_backend: ClassVar[str] = "gloo"
    default_compile_backend: ClassVar[str] = "inductor"
    static_graph_wrapper: ClassVar[str | None] = None

    @classmethod
    def is_available(cls) -> bool:
        return True

    def _probe_capability(self) -> DeviceCapability:
        return CPU_CAPABILITY
