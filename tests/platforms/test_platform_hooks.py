"""Platform hooks on a CPU machine: what each built-in platform answers, with torch.cuda faked.

Proves that ``CudaPlatform`` and ``RocmPlatform`` forward each hook to the ``torch.cuda`` call
that does the work (seeding every device, the pool handle, the capture's error mode, a skipped
gc on later pieces), read their capability from the device properties, and say in words why they
are unavailable; that the ``Platform`` base answers the CPU defaults and names what a backend
lacks; that ``CpuPlatform`` caps the KV cache; and that ``current_platform()`` is resolved once
and forgotten on reset. The CUDA calls themselves run only on a GPU (the normal suite there).

Run: pytest tests/platforms/test_platform_hooks.py
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
from types import SimpleNamespace

import pytest
import torch

from pieceworks import platforms
from pieceworks.config import EngineConfig
from pieceworks.core.config import CompilationConfig, CUDAGraphMode
from pieceworks.platforms.capability import (
    FP8_GEMM,
    PROGRAMMATIC_LAUNCH,
    TRITON,
    WARPGROUP_MMA,
    DeviceCapability,
    amd_capability,
    nvidia_capability,
)
from pieceworks.platforms.cpu import DEFAULT_KV_CACHE_MEMORY_BYTES, CpuPlatform
from pieceworks.platforms.cuda import CudaPlatform, device_facts
from pieceworks.platforms.interface import Platform
from pieceworks.platforms.rocm import RocmPlatform

H100_PROPERTIES = SimpleNamespace(
    name="NVIDIA H100", multi_processor_count=132, shared_memory_per_block_optin=232448
)


@pytest.fixture
def cuda_build(monkeypatch):
    """A CUDA build of torch with one visible device."""
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    monkeypatch.setattr(torch.version, "cuda", "12.8", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


def test_cuda_is_available_only_on_a_cuda_build_with_a_device(cuda_build, monkeypatch):
    platform = CudaPlatform()
    assert CudaPlatform.is_available() and not RocmPlatform.is_available()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not CudaPlatform.is_available()
    assert platform.unavailable_reason() == (
        "torch.cuda.is_available() is False (no visible NVIDIA device or driver)"
    )
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.version, "cuda", None)
    assert not CudaPlatform.is_available()
    assert platform.unavailable_reason() == "this torch build has no CUDA support (CPU-only build)"
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.version, "hip", "6.2.0")
    assert not CudaPlatform.is_available()
    assert platform.unavailable_reason() == "this torch is a ROCm (HIP) build"


def test_rocm_is_available_only_on_a_hip_build_with_a_device(monkeypatch):
    platform = RocmPlatform()
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert not RocmPlatform.is_available()
    assert platform.unavailable_reason() == "this torch build is not a ROCm (HIP) build"
    monkeypatch.setattr(torch.version, "hip", "6.2.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not RocmPlatform.is_available()
    assert platform.unavailable_reason() == (
        "torch.cuda.is_available() is False (no visible AMD device or driver)"
    )


def test_cuda_capability_comes_from_the_device_properties(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda: H100_PROPERTIES)
    capability = CudaPlatform().device_capability()
    assert (capability.num_compute_units, capability.shared_memory_per_block) == (132, 232448)
    assert capability == nvidia_capability(
        9, 0, num_compute_units=132, shared_memory_per_block=232448
    )
    assert capability.describe() == (
        "nvidia sm_90; features: fp8_gemm, programmatic_launch, triton, warpgroup_mma; "
        "fp8: float8_e4m3fn"
    )
    older = SimpleNamespace(multi_processor_count=80)  # no opt-in shared memory attribute
    assert device_facts(older) == {"num_compute_units": 80, "shared_memory_per_block": None}


def test_rocm_capability_and_name_come_from_the_gcn_arch(monkeypatch):
    mi300 = SimpleNamespace(
        name="AMD Instinct MI300X",
        gcnArchName="gfx942:sramecc+:xnack-",
        multi_processor_count=304,
        shared_memory_per_block_optin=65536,
    )
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda: mi300)
    platform = RocmPlatform()
    assert platform.device_capability() == amd_capability(
        "gfx942", num_compute_units=304, shared_memory_per_block=65536
    )
    assert platform.device_capability().fp8_dtype == torch.float8_e4m3fnuz
    assert platform.device_name() == "AMD Instinct MI300X (gfx942:sramecc+:xnack-)"
    unnamed = SimpleNamespace(name="AMD GPU", multi_processor_count=1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda: unnamed)
    assert RocmPlatform().device_capability().arch_name == "unknown"
    assert RocmPlatform().device_name() == "AMD GPU (unknown arch)"


class _Recorder:
    """Stands in for a torch.cuda function: records its arguments, returns ``result``."""

    def __init__(self, result=None):
        self.result, self.calls = result, []

    def __call__(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        return self.result


@pytest.mark.parametrize(
    "hook, args, cuda_function, result",
    [
        ("device_count", (), "device_count", 8),
        ("set_device", (torch.device("cuda", 3),), "set_device", None),
        ("synchronize", (), "synchronize", None),
        ("mem_get_info", (), "mem_get_info", (1 << 30, 1 << 34)),
        ("empty_cache", (), "empty_cache", None),
        ("device_name", (), "get_device_name", "NVIDIA H200"),
        ("memory_allocated", (), "memory_allocated", 1234),
        ("max_memory_allocated", (), "max_memory_allocated", 5678),
        ("reset_peak_memory_stats", (), "reset_peak_memory_stats", None),
        ("create_graph", (), "CUDAGraph", "graph"),
    ],
)
def test_each_cuda_hook_calls_its_torch_cuda_function(
    monkeypatch, hook, args, cuda_function, result
):
    recorder = _Recorder(result)
    monkeypatch.setattr(torch.cuda, cuda_function, recorder)
    assert getattr(CudaPlatform(), hook)(*args) == result
    assert recorder.calls == [(args, {})]


def test_cuda_events_time_only_when_asked(monkeypatch):
    recorder = _Recorder("event")
    monkeypatch.setattr(torch.cuda, "Event", recorder)
    platform = CudaPlatform()
    assert platform.create_event() == platform.create_event(timing=True) == "event"
    assert recorder.calls == [((), {"enable_timing": False}), ((), {"enable_timing": True})]


def test_cuda_seeds_the_host_and_every_device(monkeypatch):
    seeded = _Recorder()
    monkeypatch.setattr(torch.cuda, "manual_seed_all", seeded)
    CudaPlatform().manual_seed(1234)
    assert seeded.calls and all(call == ((1234,), {}) for call in seeded.calls)
    first = torch.rand(3)
    torch.manual_seed(1234)
    assert torch.equal(first, torch.rand(3))


def test_cuda_pins_staging_memory_and_traces_cuda_activity():
    platform = CudaPlatform()
    assert platform.pin_memory() is True
    assert platform.profiler_activity() == torch.profiler.ProfilerActivity.CUDA


def test_cuda_graph_pool_is_one_handle_held_open_by_a_graph_until_renewed(monkeypatch):
    """A pool whose graphs were all destroyed takes no new capture on CUDA: a graph captured
    into it when it is made stays referenced until the pool is renewed."""
    handles = iter(["pool-1", "pool-2"])
    captured = []

    @contextlib.contextmanager
    def fake_graph(graph, pool=None, capture_error_mode="global"):
        captured.append((graph, pool))
        yield

    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: next(handles))
    monkeypatch.setattr(torch.cuda, "CUDAGraph", object)
    monkeypatch.setattr(torch.cuda, "graph", fake_graph)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    platform = CudaPlatform()
    assert platform.graph_pool() == "pool-1"
    assert platform.graph_pool() == "pool-1"
    assert [pool for _, pool in captured] == ["pool-1"]
    assert platform._pool_keeper is captured[0][0]
    platform.renew_graph_pool()
    assert platform._pool_keeper is None
    assert platform.graph_pool() == "pool-2"
    assert [pool for _, pool in captured] == ["pool-1", "pool-2"]


def test_a_cuda_platform_with_graphs_turned_off_makes_no_pool(monkeypatch):
    """A plugin that subclasses CudaPlatform without static graphs allocates no graph pool."""

    class NoGraphs(CudaPlatform):
        static_graph_wrapper = None

    handles = _Recorder("pool")
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", handles)
    assert NoGraphs().graph_pool() is None
    assert handles.calls == []


@pytest.mark.parametrize("skip_gc", [False, True])
def test_cuda_capture_is_thread_local_into_the_pool_and_skips_gc_after_the_first_piece(
    monkeypatch, skip_gc
):
    captures = []
    real_collect, real_empty_cache = gc.collect, torch.cuda.empty_cache

    @contextlib.contextmanager
    def fake_graph(graph, pool=None, capture_error_mode="global"):
        # torch.cuda.graph collects garbage and empties the cache on entry.
        captures.append((graph, pool, capture_error_mode, gc.collect(), torch.cuda.empty_cache()))
        yield

    monkeypatch.setattr(torch.cuda, "graph", fake_graph)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: "emptied")
    with CudaPlatform().graph_capture("graph", "pool", skip_gc=skip_gc):
        pass
    graph, pool, mode, collected, emptied = captures[0]
    assert (graph, pool, mode) == ("graph", "pool", "thread_local")
    if skip_gc:
        assert (collected, emptied) == (None, None)
    else:
        assert isinstance(collected, int) and emptied == "emptied"
    assert gc.collect is real_collect
    monkeypatch.undo()
    assert torch.cuda.empty_cache is real_empty_cache


# ---------------------------------------------------------------- the Platform base


class _BarePlatform(Platform):
    name = "bare"


def test_the_base_platform_names_what_a_backend_lacks():
    platform = _BarePlatform()
    with pytest.raises(NotImplementedError, match="^platform 'bare' does not implement is_avai"):
        _BarePlatform.is_available()
    assert platform.unavailable_reason() == "is_available() returned False"
    with pytest.raises(NotImplementedError, match="^platform 'bare' has no device graphs$"):
        platform.create_graph()
    with pytest.raises(NotImplementedError, match="^platform 'bare' has no device graphs$"):
        platform.graph_capture(None, None)
    with pytest.raises(RuntimeError) as error:
        platform.static_graph_wrapper_cls()
    assert str(error.value) == (
        "platform 'bare' has no static graphs; set cudagraph_mode=NONE "
        "(check_and_update_config does this)"
    )
    assert not platform.supports_breakable_graphs()


def test_the_base_platform_answers_the_host_defaults():
    from pieceworks.models.attention.backends import TorchAttentionBackend
    from pieceworks.models.mamba.backends import TorchMambaBackend

    platform = _BarePlatform()
    assert platform.attention_backend() is TorchAttentionBackend
    assert platform.mamba_backend() is TorchMambaBackend
    assert platform.device_capability() == DeviceCapability(vendor="bare")
    assert platform.device_capability() is platform.device_capability()
    assert platform.device() == torch.device("cpu") and platform.device(1) == torch.device("cpu")
    assert CudaPlatform().device(2) == torch.device("cuda", 2)
    assert CudaPlatform().device() == torch.device("cuda", 0)
    assert platform.device_count() == 1
    assert platform.create_event() is None and platform.profiler_activity() is None
    assert platform.device_name() == "bare"
    assert platform.memory_allocated() == 0 and platform.max_memory_allocated() == 0
    assert platform.pin_memory() is False
    assert platform.graph_pool() is None
    assert repr(platform) == "_BarePlatform(name='bare', device_type='cpu')"
    free, total = platform.mem_get_info()
    assert total == os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert 0 < free <= total


def test_the_base_platform_seeds_torch():
    _BarePlatform().manual_seed(7)
    first = torch.rand(4)
    torch.manual_seed(7)
    assert torch.equal(first, torch.rand(4))


def test_a_platform_without_init_still_remembers_its_capability():
    class NoInit(_BarePlatform):
        def __init__(self) -> None:  # a subclass that skips Platform.__init__
            pass

    platform = NoInit()
    assert platform.device_capability() is platform.device_capability()


def test_breakable_graphs_follow_the_wrapper_s_opt_in():
    class Wrapper:
        supports_breakable_capture = True

    class Opted(_BarePlatform):
        static_graph_wrapper = f"{__name__}.test_breakable_graphs_follow_the_wrapper_s_opt_in"

        def static_graph_wrapper_cls(self) -> type:
            return Wrapper

    class NotOpted(Opted):
        def static_graph_wrapper_cls(self) -> type:
            return object

    assert Opted().supports_breakable_graphs() is True
    assert NotOpted().supports_breakable_graphs() is False
    assert CudaPlatform().supports_breakable_graphs() is True


def test_declared_defaults_turn_graphs_off_where_there_are_none(monkeypatch, caplog):
    monkeypatch.setattr(platforms, "_current", CpuPlatform())
    with caplog.at_level(logging.INFO, logger="pieceworks.platforms.interface"):
        config = EngineConfig(
            compilation_config=CompilationConfig(level=3, cudagraph_mode="PIECEWISE")
        )
    assert config.compilation_config.backend == "inductor"
    assert config.compilation_config.cudagraph_mode == CUDAGraphMode.NONE
    assert "platform cpu has no static graphs: cudagraph_mode PIECEWISE turned off (NONE)" in (
        caplog.messages
    )
    explicit = EngineConfig(compilation_config=CompilationConfig(level=3, backend="eager"))
    assert explicit.compilation_config.backend == "eager"


def test_level_0_graphs_go_off_where_the_wrapper_cannot_capture_segments(monkeypatch, caplog):
    class NoSegments(CudaPlatform):
        def supports_breakable_graphs(self) -> bool:
            return False

    class Segments(CudaPlatform):
        pass

    monkeypatch.setattr(platforms, "_current", NoSegments())
    with caplog.at_level(logging.INFO, logger="pieceworks.platforms.interface"):
        config = EngineConfig(
            compilation_config=CompilationConfig(level=0, cudagraph_mode="PIECEWISE")
        )
    assert config.compilation_config.cudagraph_mode == CUDAGraphMode.NONE
    assert caplog.messages[-1] == (
        "platform cuda cannot capture breakable graphs (its static-graph wrapper has no "
        "segment capture): cudagraph_mode PIECEWISE at level 0 turned off (NONE)"
    )
    monkeypatch.setattr(platforms, "_current", Segments())
    kept = EngineConfig(compilation_config=CompilationConfig(level=0, cudagraph_mode="PIECEWISE"))
    assert kept.compilation_config.cudagraph_mode == CUDAGraphMode.PIECEWISE
    full = EngineConfig(compilation_config=CompilationConfig(level=3, cudagraph_mode="FULL"))
    assert full.compilation_config.cudagraph_mode == CUDAGraphMode.FULL


def test_cpu_caps_the_kv_cache_unless_it_was_sized(monkeypatch, caplog):
    monkeypatch.setattr(platforms, "_current", CpuPlatform())
    with caplog.at_level(logging.INFO, logger="pieceworks.platforms.cpu"):
        config = EngineConfig()
    assert config.cache_config.kv_cache_memory_bytes == DEFAULT_KV_CACHE_MEMORY_BYTES == 4 << 30
    assert caplog.messages[-1] == (
        "platform cpu: KV cache capped at 4.0 GiB of host memory (set "
        "kv_cache_memory_bytes / --kv-cache-memory-bytes to change it)"
    )
    sized = EngineConfig()
    sized.cache_config.kv_cache_memory_bytes = 1 << 20
    CpuPlatform().check_and_update_config(sized)
    assert sized.cache_config.kv_cache_memory_bytes == 1 << 20


# ---------------------------------------------------------------- capabilities


def test_nvidia_features_by_compute_capability():
    assert nvidia_capability(8, 6).features == {TRITON}
    assert nvidia_capability(8, 9).features == {TRITON, FP8_GEMM}
    assert nvidia_capability(9, 0).features == {
        TRITON,
        FP8_GEMM,
        PROGRAMMATIC_LAUNCH,
        WARPGROUP_MMA,
    }
    assert nvidia_capability(10, 0).features == {TRITON, FP8_GEMM, PROGRAMMATIC_LAUNCH}
    assert nvidia_capability(12, 0).arch_name == "sm_120"
    assert nvidia_capability(12, 0).arch == (12, 0)
    assert nvidia_capability(12, 0).vendor == "nvidia"


@pytest.mark.parametrize(
    "gcn_arch_name, arch, fp8_dtype",
    [
        ("gfx942:sramecc+:xnack-", (9, 4), torch.float8_e4m3fnuz),
        ("gfx90a", (9, 0), torch.float8_e4m3fn),
        ("gfx1100", (11, 0), torch.float8_e4m3fn),
        ("gfx950", (9, 5), torch.float8_e4m3fn),
        ("gfx9", None, torch.float8_e4m3fn),
        ("gfx94", None, torch.float8_e4m3fnuz),
        ("gfxabc", None, torch.float8_e4m3fn),
        ("unknown", None, torch.float8_e4m3fn),
    ],
)
def test_amd_architecture_is_parsed_from_the_gfx_name(gcn_arch_name, arch, fp8_dtype):
    capability = amd_capability(gcn_arch_name, num_compute_units=304)
    assert capability.arch == arch
    assert capability.arch_name == gcn_arch_name.split(":")[0]
    assert capability.fp8_dtype == fp8_dtype
    native_fp8 = capability.arch_name.startswith(("gfx94", "gfx95"))  # hipBLASLt FP8 GEMMs
    assert capability.vendor == "amd"
    assert capability.features == ({TRITON, FP8_GEMM} if native_fp8 else {TRITON})
    assert capability.num_compute_units == 304


def test_describe_says_what_is_unknown():
    assert DeviceCapability(vendor="x").describe() == "x ?; features: none; fp8: float8_e4m3fn"
    assert DeviceCapability(vendor="x", arch=(3, 5)).describe() == (
        "x 3.5; features: none; fp8: float8_e4m3fn"
    )
    assert (
        amd_capability("gfx942").describe()
        == "amd gfx942; features: fp8_gemm, triton; fp8: float8_e4m3fnuz"
    )
    with pytest.raises(ValueError) as error:
        DeviceCapability(vendor="x", features=frozenset({"b_magic", "a_magic", TRITON}))
    assert str(error.value) == (
        "unknown device features ['a_magic', 'b_magic']; known: triton, warpgroup_mma, "
        "programmatic_launch, fp8_gemm"
    )


# ---------------------------------------------------------------- current_platform()


def test_current_platform_is_resolved_once_and_forgotten_on_reset(fresh_platform, monkeypatch):
    monkeypatch.setenv("PIECEWORKS_PLATFORM", "cpu")
    assert not platforms.is_platform_resolved()
    platform = platforms.current_platform()
    assert isinstance(platform, CpuPlatform) and platforms.is_platform_resolved()
    assert platforms.current_platform() is platform
    assert platforms.describe_platform_resolution() == platforms.platform_resolution().describe()
    assert "cpu" in platforms.describe_platform_resolution()
    platforms.reset_platform()
    assert not platforms.is_platform_resolved()
    assert platforms.current_platform() is not platform


def test_use_platform_installs_a_fresh_instance(fresh_platform):
    platform = platforms.use_platform(RocmPlatform)
    assert type(platform) is RocmPlatform
    assert platforms.current_platform() is platform
    assert platforms.is_platform_resolved()
