"""The CPU platform: no static graphs, torch reference kernels, gloo for distributed runs."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from pieceworks.logger import init_logger
from pieceworks.platforms.capability import CPU_CAPABILITY, DeviceCapability
from pieceworks.platforms.interface import Platform

if TYPE_CHECKING:
    from pieceworks.config import EngineConfig

logger = init_logger(__name__)

# The KV cache's default size where device memory is host memory (vLLM's CPU default is 4 GiB).
DEFAULT_KV_CACHE_MEMORY_BYTES = 4 * 1024**3


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

    def check_and_update_config(self, config: EngineConfig) -> None:
        """The base adjustments, and a KV cache capped at ``DEFAULT_KV_CACHE_MEMORY_BYTES``:
        device memory is host RAM here, and sizing the cache from it would take most of it."""
        super().check_and_update_config(config)
        cache_config = config.cache_config
        if cache_config.kv_cache_memory_bytes is None:
            cache_config.kv_cache_memory_bytes = DEFAULT_KV_CACHE_MEMORY_BYTES
            logger.info(
                "platform %s: KV cache capped at %.1f GiB of host memory (set "
                "kv_cache_memory_bytes / --kv-cache-memory-bytes to change it)",
                self.name,
                DEFAULT_KV_CACHE_MEMORY_BYTES / 1024**3,
            )

    def _probe_capability(self) -> DeviceCapability:
        return CPU_CAPABILITY
