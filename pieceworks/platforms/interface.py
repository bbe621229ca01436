"""The ``Platform`` base class: everything pieceworks asks of a hardware backend.

A platform names its static-graph wrapper and attention backend by qualname strings, imported only
when asked for, so this layer depends on nothing above it. The compile pipeline, the models and the
runner never branch on hardware: they call these members on ``current_platform()``.
A new backend subclasses ``Platform`` (or a built-in) and overrides what differs; see
``docs/platforms.md``. The contract is versioned and checked when a subclass is defined
(``contract.py``); what a platform supports is one declared record, ``capabilities()``.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from pieceworks.logger import init_logger
from pieceworks.platforms.capability import DeviceCapability, PlatformCapabilities
from pieceworks.platforms.contract import CONTRACT_VERSION, check_platform_class
from pieceworks.utils import resolve_obj_by_qualname

if TYPE_CHECKING:
    from pieceworks.config import EngineConfig

logger = init_logger(__name__)


class Platform:
    """Hardware backend interface. Subclasses set the class attributes and override the hooks.

    Defining a subclass checks it (``contract.check_platform_class``): each public name must be a
    member below, or listed in the subclass's ``extra_members``; an overriding hook must accept
    the hook's parameters. A plugin states ``contract_version``, checked at resolution.
    """

    # The contract version this class implements: (major, minor), CONTRACT_VERSION here.
    contract_version: ClassVar[tuple[int, int]] = CONTRACT_VERSION
    # Public names a subclass adds of its own (not contract members; underscore names need none).
    extra_members: ClassVar[tuple[str, ...]] = ()
    name: ClassVar[str] = "base"
    device_type: ClassVar[str] = "cpu"  # torch device string
    dispatch_key: ClassVar[str] = "CPU"  # torch.library dispatch key for pieceworks' custom ops
    dist_backend: ClassVar[str] = "gloo"  # torch.distributed backend
    default_compile_backend: ClassVar[str] = "inductor"
    # Qualname of the static-graph wrapper class (StaticGraphWrapper protocol); None: no graphs.
    static_graph_wrapper: ClassVar[str | None] = None
    # Qualnames of the attention and Mamba2 kernel backends the models use on this platform.
    attention_backend_qualname: ClassVar[str] = (
        "pieceworks.models.attention.backends.TorchAttentionBackend"
    )
    mamba_backend_qualname: ClassVar[str] = "pieceworks.models.mamba.backends.TorchMambaBackend"
    # The FP8 dtypes this platform's devices may convert (DeviceCapability.fp8_dtype is one).
    fp8_formats: ClassVar[tuple[torch.dtype, ...]] = (torch.float8_e4m3fn,)
    # Whether every graph captured takes its memory from the one pool of ``graph_pool()``.
    graph_pool_sharing: ClassVar[bool] = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        check_platform_class(cls, Platform)

    def __init__(self) -> None:
        self._graph_pool: Any = None
        self._graph_pool_created = False
        self._capability: DeviceCapability | None = None
        self._capabilities: PlatformCapabilities | None = None

    def capabilities(self) -> PlatformCapabilities:
        """What this platform declares it supports, built once from its declarations (the class
        attributes, ``supports_static_graphs``, ``supports_breakable_graphs``). The engine reads
        this record; it asks the device nothing."""
        if getattr(self, "_capabilities", None) is None:  # a subclass may skip __init__
            static_graphs = self.supports_static_graphs()
            self._capabilities = PlatformCapabilities(
                static_graphs=static_graphs,
                graph_pool_sharing=static_graphs and self.graph_pool_sharing,
                breakable_capture=static_graphs and self.supports_breakable_graphs(),
                dispatch_key=self.dispatch_key,
                fp8_formats=tuple(self.fp8_formats),
                dist_backend=self.dist_backend,
            )
        assert self._capabilities is not None
        return self._capabilities

    # --- discovery -----------------------------------------------------------------------------
    @classmethod
    def is_available(cls) -> bool:
        """Whether this platform can run here. Must not create a device context."""
        raise NotImplementedError(f"platform {cls.name!r} does not implement is_available()")

    def unavailable_reason(self) -> str:
        """Why ``is_available()`` is false, in words, for `pieceworks platforms`."""
        return "is_available() returned False"

    # --- static graphs -------------------------------------------------------------------------
    def supports_static_graphs(self) -> bool:
        return self.static_graph_wrapper is not None

    def static_graph_wrapper_cls(self) -> type:
        """The class named by ``static_graph_wrapper``, imported on first use."""
        if self.static_graph_wrapper is None:
            raise RuntimeError(
                f"platform {self.name!r} has no static graphs; "
                "set cudagraph_mode=NONE (check_and_update_config does this)"
            )
        return resolve_obj_by_qualname(self.static_graph_wrapper)

    def supports_breakable_graphs(self) -> bool:
        """Whether the static-graph wrapper captures segments (breakable graphs at level 0).

        The wrapper class opts in with ``supports_breakable_capture = True`` and the segment
        primitives of ``StaticGraphWrapperBase``; ``CUDAGraphWrapper`` does (so ROCm does too).
        """
        if not self.supports_static_graphs():
            return False
        return bool(getattr(self.static_graph_wrapper_cls(), "supports_breakable_capture", False))

    def graph_pool(self) -> Any:
        """One process-wide memory pool shared by every captured graph (None if no graphs)."""
        if not self._graph_pool_created:
            self._graph_pool = self._create_graph_pool() if self.supports_static_graphs() else None
            self._graph_pool_created = True
        return self._graph_pool

    def renew_graph_pool(self) -> None:
        """Later captures go to a new pool. Called once graphs were released: on CUDA a pool whose
        graphs were all destroyed takes no new captures while its memory is still cached."""
        self._graph_pool, self._graph_pool_created = None, False

    def _create_graph_pool(self) -> Any:
        return None

    def create_graph(self) -> Any:
        """A new, empty device graph object (used by ``CUDAGraphWrapper``)."""
        raise NotImplementedError(f"platform {self.name!r} has no device graphs")

    def graph_capture(self, graph: Any, pool: Any, *, skip_gc: bool = False) -> Any:
        """Context manager recording device work into ``graph`` using memory from ``pool``."""
        raise NotImplementedError(f"platform {self.name!r} has no device graphs")

    # --- kernels and compile -------------------------------------------------------------------
    def attention_backend(self) -> type:
        """The attention implementation class the models use on this platform."""
        return resolve_obj_by_qualname(self.attention_backend_qualname)

    def mamba_backend(self) -> type:
        """The Mamba2 kernel implementation class the models use on this platform."""
        return resolve_obj_by_qualname(self.mamba_backend_qualname)

    def prepare_kernel_compiler(self, cache_dir: str | None) -> dict[str, str]:
        """The environment this platform's kernel compiler (Triton) needs before the first kernel
        compiles, as ``{variable: value}``: with ``cache_dir``, compiled binaries go there
        (``TRITON_CACHE_DIR``); a platform adds its own toolchain's settings. Pure: engine
        start-up applies the result once per process, keeping every variable the user set
        (``core/cache/triton_cache.py``), so that Inductor's compile workers inherit it too."""
        return {} if cache_dir is None else {"TRITON_CACHE_DIR": cache_dir}

    def device_capability(self) -> DeviceCapability:
        """What this platform's device is and has (vendor, architecture, compute units, shared
        memory, features, FP8 format), asked once and remembered. Kernels choose their
        implementations from it; subclasses override ``_probe_capability``."""
        if getattr(self, "_capability", None) is None:  # a subclass may skip __init__
            self._capability = self._probe_capability()
        assert self._capability is not None
        return self._capability

    def _probe_capability(self) -> DeviceCapability:
        return DeviceCapability(vendor=self.name)

    def check_and_update_config(self, config: EngineConfig) -> None:
        """The one place a platform adjusts an EngineConfig. Every change is logged. An override
        need not call this: ``apply_declared_defaults`` runs after it in any case."""
        self.apply_declared_defaults(config)

    def apply_declared_defaults(self, config: EngineConfig) -> None:
        """What the platform's class attributes and capabilities declare, applied to ``config``
        after ``check_and_update_config`` (so an override that skips the base class still gets
        them): the compile backend where none was asked for, static graphs off where the
        platform has none, breakable graphs off where its wrapper cannot capture segments."""
        from pieceworks.core.config import CompilationLevel, CUDAGraphMode

        compilation = config.compilation_config
        assert compilation.cudagraph_mode is not None  # resolved in __post_init__
        capabilities = self.capabilities()
        if compilation.backend is None:
            compilation.backend = self.default_compile_backend
        if compilation.cudagraph_mode != CUDAGraphMode.NONE and not capabilities.static_graphs:
            logger.info(
                "platform %s has no static graphs: cudagraph_mode %s turned off (NONE)",
                self.name,
                compilation.cudagraph_mode.name,
            )
            compilation.cudagraph_mode = CUDAGraphMode.NONE
        breakable = compilation.level == CompilationLevel.NO_COMPILATION
        mode = compilation.cudagraph_mode
        if breakable and mode.has_piecewise_cudagraphs() and not capabilities.breakable_capture:
            logger.info(
                "platform %s cannot capture breakable graphs (its static-graph wrapper has no "
                "segment capture): cudagraph_mode %s at level 0 turned off (NONE)",
                self.name,
                mode.name,
            )
            compilation.cudagraph_mode = CUDAGraphMode.NONE

    # --- device helpers ------------------------------------------------------------------------
    def device(self, index: int = 0) -> torch.device:
        return (
            torch.device(self.device_type, index)
            if self.device_type != "cpu"
            else torch.device("cpu")
        )

    def set_device(self, device: torch.device) -> None:
        """Bind this process to ``device`` (a no-op where there is one device)."""

    def device_count(self) -> int:
        return 1

    def synchronize(self) -> None:
        """Wait for all queued device work."""

    def create_event(self, timing: bool = False) -> Any | None:
        """A device event (``record()``, ``synchronize()``) to wait for queued work up to a point;
        with ``timing``, also ``elapsed_time(later)`` in ms between two recorded events. None where
        device work completes before the host call returns (the CPU)."""
        return None

    def profiler_activity(self) -> Any | None:
        """The ``torch.profiler.ProfilerActivity`` that records this device's kernels and copies
        (for the device-busy time of a decode step); None where the device's work is not traced
        separately from the host's (the CPU), so no device-busy time is reported."""
        return None

    def mem_get_info(self) -> tuple[int, int]:
        """(free bytes, total bytes) of device memory."""
        page = os.sysconf("SC_PAGE_SIZE")
        return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page

    def empty_cache(self) -> None:
        """Return cached, unused device memory to the driver."""

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def device_name(self) -> str:
        return self.name

    def memory_allocated(self) -> int:
        """Bytes currently held by tensors on the device (0 where unknown)."""
        return 0

    def max_memory_allocated(self) -> int:
        """Peak bytes held by tensors since the last reset (0 where unknown)."""
        return 0

    def reset_peak_memory_stats(self) -> None:
        """Start a new peak for ``max_memory_allocated``."""

    def pin_memory(self) -> bool:
        """Whether host staging buffers should be pinned for asynchronous copies."""
        return False

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, device_type={self.device_type!r})"
