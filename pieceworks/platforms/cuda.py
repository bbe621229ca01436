"""The CUDA platform (NVIDIA): CUDA Graphs via ``torch.cuda.CUDAGraph``, Triton kernels, NCCL.

Triton's key for a kernel binary holds the version of the ``ptxas`` that assembled it, and Inductor
changes which one mid-process: the first time it compiles a Triton kernel in a process it points
``TRITON_PTXAS_PATH`` at the ``ptxas`` torch ships (``torch/bin/ptxas``;
``torch._inductor.runtime.compile_tasks._set_triton_ptxas_path``), where Triton would use its own.
A cold start compiles with Inductor; a warm start only loads. On the H200 a warm start of
``llama-125m`` compiled 25 kernels the cold start had built (pieceworks' own and 4 of Inductor's;
4.9 s of its 13.5 s), and a second warm start compiled none: the two kinds of process keyed the
same kernels differently, which the ``ptxas`` switch explains. So the platform makes Inductor's
choice up front (``prepare_kernel_compiler``: ``torch_ptxas``), applied before any kernel compiles,
and every process assembles with the same ``ptxas``. A ``TRITON_PTXAS_PATH`` the user set is kept;
a torch without its own ``ptxas`` changes nothing. That this removes the warm start's compiles is
still to be measured on the H200 (``docs/performance.md``, "Startup").
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar
from unittest import mock

import torch

from pieceworks.logger import init_logger
from pieceworks.platforms.capability import DeviceCapability, nvidia_capability
from pieceworks.platforms.interface import Platform

logger = init_logger(__name__)


class CudaPlatform(Platform):
    """NVIDIA GPUs. ROCm reuses all of this through the same ``torch.cuda`` API (see rocm.py)."""

    name: ClassVar[str] = "cuda"
    device_type: ClassVar[str] = "cuda"
    dispatch_key: ClassVar[str] = "CUDA"
    dist_backend: ClassVar[str] = "nccl"
    default_compile_backend: ClassVar[str] = "inductor"
    static_graph_wrapper: ClassVar[str | None] = "pieceworks.core.cuda_graph.CUDAGraphWrapper"
    attention_backend_qualname: ClassVar[str] = (
        "pieceworks.models.attention.backends.TritonAttentionBackend"
    )
    mamba_backend_qualname: ClassVar[str] = "pieceworks.models.mamba.backends.TritonMambaBackend"

    @classmethod
    def is_available(cls) -> bool:
        # torch.cuda.is_available() asks the driver for a device count; it creates no context.
        return (
            torch.version.hip is None
            and torch.version.cuda is not None
            and torch.cuda.is_available()
        )

    def unavailable_reason(self) -> str:
        if torch.version.hip is not None:
            return "this torch is a ROCm (HIP) build"
        if torch.version.cuda is None:
            return "this torch build has no CUDA support (CPU-only build)"
        return "torch.cuda.is_available() is False (no visible NVIDIA device or driver)"

    def _create_graph_pool(self) -> Any:
        """A new pool, held open by one tiny graph captured into it (``_pool_keeper``).

        The caching allocator refuses a capture into a pool whose graphs were all destroyed while
        memory it allocated is still cached (``use_count > 0 INTERNAL ASSERT FAILED``, and the
        failed capture leaves the RNG expecting a capture: every later random op raises). That
        happens whenever an engine's or a test's graphs are garbage collected without
        ``ModelRunner.release_graphs``; the keeper makes it impossible until the pool is renewed.
        """
        handle = torch.cuda.graph_pool_handle()
        keeper = torch.cuda.CUDAGraph()
        with torch.cuda.graph(keeper, pool=handle, capture_error_mode="thread_local"):
            torch.zeros(1, device=torch.cuda.current_device())  # one kernel: no empty graph
        self._pool_keeper: torch.cuda.CUDAGraph | None = keeper
        return handle

    def renew_graph_pool(self) -> None:
        super().renew_graph_pool()
        self._pool_keeper = None  # the old pool's memory can go once its graphs are gone

    def create_graph(self) -> torch.cuda.CUDAGraph:
        return torch.cuda.CUDAGraph()

    @contextlib.contextmanager
    def graph_capture(self, graph: Any, pool: Any, *, skip_gc: bool = False) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            if skip_gc:
                # torch.cuda.graph() runs gc.collect() and empty_cache() on entry; for every piece
                # after the first that only costs time (the first piece already did it).
                stack.enter_context(mock.patch("gc.collect", lambda: None))
                stack.enter_context(mock.patch("torch.cuda.empty_cache", lambda: None))
            # "thread_local": only this thread's calls are checked during capture. In "global"
            # mode (torch's default) a CUDA call from any other thread, such as the event polling
            # of ProcessGroupNCCL's watchdog after the warm-up runs' all-reduces, would invalidate
            # the capture. (The TP=2 hang once suspected of this was the shutdown instead.)
            stack.enter_context(
                torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local")
            )
            yield

    def prepare_kernel_compiler(self, cache_dir: str | None) -> dict[str, str]:
        """Triton's cache directory, and torch's own ``ptxas`` where torch ships one (module
        docstring: every process then assembles with the ``ptxas`` Inductor would switch to)."""
        environment = super().prepare_kernel_compiler(cache_dir)
        ptxas = torch_ptxas()
        if ptxas is not None:
            environment["TRITON_PTXAS_PATH"] = ptxas
            logger.debug("Triton assembles with torch's ptxas: %s", ptxas)
        return environment

    def _probe_capability(self) -> DeviceCapability:
        major, minor = torch.cuda.get_device_capability()
        properties = torch.cuda.get_device_properties()
        return nvidia_capability(major, minor, **device_facts(properties))

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def set_device(self, device: torch.device) -> None:
        torch.cuda.set_device(device)

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def create_event(self, timing: bool = False) -> torch.cuda.Event:
        return torch.cuda.Event(enable_timing=timing)

    def profiler_activity(self) -> Any:
        # CUPTI traces kernels, copies and memsets, also those replayed inside a CUDA graph; ROCm
        # builds of torch report HIP activity under the same name (roctracer).
        return torch.profiler.ProfilerActivity.CUDA

    def mem_get_info(self) -> tuple[int, int]:
        return torch.cuda.mem_get_info()

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)
        torch.cuda.manual_seed_all(seed)

    def device_name(self) -> str:
        return torch.cuda.get_device_name()

    def memory_allocated(self) -> int:
        return torch.cuda.memory_allocated()

    def max_memory_allocated(self) -> int:
        return torch.cuda.max_memory_allocated()

    def reset_peak_memory_stats(self) -> None:
        torch.cuda.reset_peak_memory_stats()

    def pin_memory(self) -> bool:
        return True


def torch_ptxas(torch_dir: str | None = None) -> str | None:
    """torch's own ``ptxas`` (``<torch_dir>/bin/ptxas``; the installed torch's by default) where
    it is an executable file, else None (CPU and ROCm builds ship none)."""
    if torch_dir is None:
        torch_dir = os.path.dirname(torch.__file__)
    ptxas = Path(torch_dir) / "bin" / "ptxas"
    return str(ptxas) if ptxas.is_file() and os.access(ptxas, os.X_OK) else None


def device_facts(properties: Any) -> dict[str, int | None]:
    """Compute units and opt-in shared memory per block from torch's device properties."""
    shared = getattr(properties, "shared_memory_per_block_optin", None)
    return {
        "num_compute_units": properties.multi_processor_count,
        "shared_memory_per_block": shared,
    }
