"""Platform resolution: forced by env, plugins and the allow-list, probes, conflicts, laziness.

Also: a plugin is forced by its entry-point name or its platform's name; installed entry points
are read from the ``pieceworks.platforms`` group; an allow-list naming an absent plugin is warned
about; the text of the resolution's description, of each warning and of the unknown-name error
(every probe on a line, then what to do) is matched in full.

Run: pytest tests/platforms/test_registry.py
"""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
import torch

from pieceworks import platforms
from pieceworks.platforms import registry
from pieceworks.platforms.cpu import CpuPlatform


class _PluginPlatform(CpuPlatform):
    name = "fakevendor"


class _OtherPluginPlatform(CpuPlatform):
    name = "othervendor"


class _UnavailablePlatform(CpuPlatform):
    name = "ghost"

    @classmethod
    def is_available(cls) -> bool:
        return False


@pytest.fixture
def plugins(fresh_platform, monkeypatch):
    """Programmatic plugins, removed after the test; no installed entry points interfere."""
    monkeypatch.setattr(registry, "entry_points", lambda group: [])
    added: list[str] = []

    def add(name: str, plugin) -> None:
        platforms.register_platform_plugin(name, plugin)
        added.append(name)

    yield add
    for name in added:
        platforms.unregister_platform_plugin(name)


def _qualname(cls: type) -> str:
    return f"{__name__}.{cls.__qualname__}"


def test_probe_resolves_cpu_on_a_cpu_only_build(plugins, monkeypatch):
    monkeypatch.delenv("PIECEWORKS_PLATFORM", raising=False)
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    assert platforms.current_platform().name == "cpu"
    resolution = platforms.platform_resolution()
    assert resolution.rule == "probe"
    assert [p.name for p in resolution.probes] == ["cuda", "rocm", "cpu"]


def test_forced_by_env(plugins, monkeypatch):
    monkeypatch.setenv("PIECEWORKS_PLATFORM", "cpu")
    assert platforms.current_platform().name == "cpu"
    assert platforms.platform_resolution().rule == "env"
    assert "forced by PIECEWORKS_PLATFORM" in platforms.describe_platform_resolution()


def test_unknown_forced_name_lists_known_platforms(plugins, monkeypatch):
    monkeypatch.setenv("PIECEWORKS_PLATFORM", "tpu9000")
    with pytest.raises(RuntimeError) as error:
        platforms.current_platform()
    message = str(error.value)
    assert "'tpu9000' is not a known platform" in message
    for name in ("cuda", "rocm", "cpu"):
        assert name in message


def test_unavailable_forced_platform_says_why(plugins, monkeypatch):
    plugins("ghost", lambda: _qualname(_UnavailablePlatform))
    monkeypatch.setenv("PIECEWORKS_PLATFORM", "ghost")
    with pytest.raises(RuntimeError, match="'ghost' is not available here") as error:
        platforms.current_platform()
    assert "is_available() returned False" in str(error.value)
    if not torch.cuda.is_available():
        assert "no CUDA support" in str(error.value)


def test_active_plugin_wins_over_builtins(plugins, monkeypatch):
    monkeypatch.delenv("PIECEWORKS_PLATFORM", raising=False)
    plugins("fakevendor", lambda: _qualname(_PluginPlatform))
    assert platforms.current_platform().name == "fakevendor"
    assert platforms.platform_resolution().rule == "plugin"


def test_declining_plugin_falls_back_to_builtins(plugins, monkeypatch):
    monkeypatch.delenv("PIECEWORKS_PLATFORM", raising=False)
    plugins("shy", lambda: None)
    assert platforms.current_platform().name in ("cuda", "rocm", "cpu")
    shy = next(p for p in platforms.platform_resolution().probes if p.name == "shy")
    assert shy.reason == "plugin declined (returned None)"


def test_allow_list_filters_plugins(plugins, monkeypatch):
    monkeypatch.delenv("PIECEWORKS_PLATFORM", raising=False)
    plugins("fakevendor", lambda: _qualname(_PluginPlatform))
    monkeypatch.setenv("PIECEWORKS_PLUGINS", "")  # empty: no plugin at all
    assert platforms.current_platform().name != "fakevendor"
    platforms.reset_platform()
    monkeypatch.setenv("PIECEWORKS_PLUGINS", "fakevendor")
    assert platforms.current_platform().name == "fakevendor"


def test_raising_probe_is_logged_and_reported(plugins, monkeypatch, caplog):
    monkeypatch.delenv("PIECEWORKS_PLATFORM", raising=False)

    def broken() -> str:
        raise OSError("driver exploded")

    plugins("broken", broken)
    logging.getLogger("pieceworks").propagate = True
    try:
        with caplog.at_level(logging.WARNING, logger="pieceworks"):
            platform = platforms.current_platform()
    finally:
        logging.getLogger("pieceworks").propagate = False
    assert platform.name in ("cuda", "rocm", "cpu")
    assert "driver exploded" in caplog.text
    assert "probe raised OSError('driver exploded')" in platforms.describe_platform_resolution()


def test_raising_builtin_probe_is_logged_and_counted_unavailable(plugins, monkeypatch, caplog):
    from pieceworks.platforms.cuda import CudaPlatform

    def broken(cls) -> bool:
        raise RuntimeError("driver exploded in the cuda probe")

    monkeypatch.setattr(CudaPlatform, "is_available", classmethod(broken))
    monkeypatch.delenv("PIECEWORKS_PLATFORM", raising=False)
    monkeypatch.setattr(logging.getLogger("pieceworks"), "propagate", True)
    with caplog.at_level(logging.WARNING, logger="pieceworks"):
        platform = platforms.current_platform()
    assert platform.name != "cuda"
    messages = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("'cuda'" in m and "driver exploded in the cuda probe" in m for m in messages)
    (cuda,) = [p for p in platforms.platform_resolution().probes if p.name == "cuda"]
    assert not cuda.available
    assert cuda.reason == "probe raised RuntimeError('driver exploded in the cuda probe')"
    platforms.reset_platform()
    monkeypatch.setenv("PIECEWORKS_PLATFORM", "cuda")  # forced: refused, with the probe's error
    with pytest.raises(RuntimeError, match="driver exploded in the cuda probe"):
        platforms.current_platform()


def test_two_active_plugins_conflict(plugins, monkeypatch):
    monkeypatch.delenv("PIECEWORKS_PLATFORM", raising=False)
    plugins("fakevendor", lambda: _qualname(_PluginPlatform))
    plugins("othervendor", lambda: _qualname(_OtherPluginPlatform))
    with pytest.raises(RuntimeError, match="more than one") as error:
        platforms.current_platform()
    # The message names both and says how to choose.
    assert "fakevendor (plugin:fakevendor), othervendor (plugin:othervendor)" in str(error.value)
    assert str(error.value).endswith(
        "Choose one with PIECEWORKS_PLATFORM=<name> or restrict PIECEWORKS_PLUGINS to one plugin."
    )


def test_forcing_one_of_two_plugins_resolves_the_conflict(plugins, monkeypatch):
    plugins("fakevendor", lambda: _qualname(_PluginPlatform))
    plugins("othervendor", lambda: _qualname(_OtherPluginPlatform))
    monkeypatch.setenv("PIECEWORKS_PLATFORM", "othervendor")
    assert platforms.current_platform().name == "othervendor"


def test_rocm_detected_on_a_simulated_hip_build(monkeypatch):
    from pieceworks.platforms.cuda import CudaPlatform
    from pieceworks.platforms.rocm import RocmPlatform

    monkeypatch.setattr(torch.version, "hip", "6.2.0", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert RocmPlatform.is_available()
    assert not CudaPlatform.is_available()
    assert registry._probe_builtin("rocm").available
    assert RocmPlatform.static_graph_wrapper == CudaPlatform.static_graph_wrapper
    assert RocmPlatform.dispatch_key == "CUDA"
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    assert not RocmPlatform.is_available()


def test_only_hopper_reports_the_warpgroup_mma(monkeypatch):
    """The resident-weight GEMV is written for wgmma: CUDA at compute capability 9.x, never
    ROCm (an MI300 reports gfx942), Blackwell (10.0) or a platform that does not say so."""
    from pieceworks.platforms.capability import WARPGROUP_MMA, amd_capability, nvidia_capability

    for capability, expected in (((9, 0), True), ((8, 9), False), ((10, 0), False)):
        assert nvidia_capability(*capability).has(WARPGROUP_MMA) is expected
    assert not amd_capability("gfx942:sramecc+:xnack-").has(WARPGROUP_MMA)
    assert not CpuPlatform().device_capability().has(WARPGROUP_MMA)


def test_device_capability_names_each_vendor_s_features_and_fp8_format():
    """NVIDIA: Triton everywhere, PDL and native FP8 GEMMs on Hopper, e4m3fn; AMD: Triton, native
    FP8 GEMMs on gfx94x/gfx95x, e4m3fnuz on the MI300 family (gfx94x) and e4m3fn after it; CPU:
    nothing; an unknown feature name is refused."""
    from pieceworks.platforms.capability import (
        FP8_GEMM,
        PROGRAMMATIC_LAUNCH,
        TRITON,
        DeviceCapability,
        amd_capability,
        nvidia_capability,
    )

    hopper = nvidia_capability(9, 0)
    assert hopper.features == {TRITON, PROGRAMMATIC_LAUNCH, FP8_GEMM, "warpgroup_mma"}
    assert hopper.fp8_dtype == torch.float8_e4m3fn and hopper.arch_name == "sm_90"
    assert nvidia_capability(8, 0).features == {TRITON}
    mi300 = amd_capability("gfx942:sramecc+:xnack-")
    assert mi300.features == {TRITON, FP8_GEMM} and mi300.arch == (9, 4)
    assert amd_capability("gfx90a").features == {TRITON}  # MI200: no FP8
    assert mi300.fp8_dtype == torch.float8_e4m3fnuz
    assert amd_capability("gfx950").fp8_dtype == torch.float8_e4m3fn
    assert CpuPlatform().device_capability().features == frozenset()
    with pytest.raises(ValueError, match="unknown device features"):
        DeviceCapability(vendor="x", features=frozenset({"tensor_magic"}))


def test_graph_pool_is_a_process_wide_singleton(graph_platform):
    pool = graph_platform.graph_pool()
    assert pool is not None
    assert graph_platform.graph_pool() is pool


def test_cpu_platform_has_no_static_graphs():
    cpu = CpuPlatform()
    assert not cpu.supports_static_graphs()
    assert cpu.graph_pool() is None
    with pytest.raises(RuntimeError, match="no static graphs"):
        cpu.static_graph_wrapper_cls()


def test_static_graph_wrapper_resolves_from_qualname():
    from pieceworks.core.cuda_graph import CUDAGraphWrapper
    from pieceworks.platforms.cuda import CudaPlatform

    assert CudaPlatform().static_graph_wrapper_cls() is CUDAGraphWrapper


def test_importing_pieceworks_does_not_resolve_the_platform():
    modules = [
        "pieceworks",
        "pieceworks.config",
        "pieceworks.envs",
        "pieceworks.platforms",
        "pieceworks.core.config",
        "pieceworks.core.custom_op",
        "pieceworks.core.cuda_graph",
        "pieceworks.core.forward_context",
        "pieceworks.entrypoints.cli",
    ]
    code = (
        "import importlib, sys\n"
        f"for name in {modules!r}: importlib.import_module(name)\n"
        "import pieceworks.platforms as p\n"
        "sys.exit(1 if p.is_platform_resolved() else 0)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_describe_names_the_rule_and_every_probe_in_aligned_columns():
    probes = [
        registry.PlatformProbe("fakevendor", "plugin:vendor", True, "", "a.B"),
        registry.PlatformProbe("cuda", "builtin", False, "no CUDA support"),
        registry.PlatformProbe("cpu", "builtin", True),
    ]
    rules = {
        "env": "forced by PIECEWORKS_PLATFORM",
        "plugin": "out-of-tree plugin",
        "probe": "first available built-in (cuda, rocm, cpu)",
    }
    for rule, words in rules.items():
        text = registry.PlatformResolution("cpu", rule, probes).describe()
        assert text.splitlines() == [
            f"resolved platform: cpu ({words})",
            "  fakevendor [plugin:vendor] available",
            "  cuda       [builtin] unavailable: no CUDA support",
            "  cpu        [builtin] available",
        ]


def test_unknown_forced_name_error_lists_each_probe_and_says_what_to_do(plugins, monkeypatch):
    plugins("ghost", lambda: _qualname(_UnavailablePlatform))
    monkeypatch.setenv("PIECEWORKS_PLATFORM", "tpu9000")
    with pytest.raises(RuntimeError) as error:
        platforms.current_platform()
    lines = str(error.value).splitlines()
    assert lines[0] == "PIECEWORKS_PLATFORM='tpu9000' is not a known platform. Platforms known:"
    assert lines[1] == "  ghost [plugin:ghost]: unavailable: is_available() returned False"
    assert [line.split(" [")[0] for line in lines[2:5]] == ["  cuda", "  rocm", "  cpu"]
    assert lines[4] == "  cpu [builtin]: available"
    assert lines[5] == (
        "Unset PIECEWORKS_PLATFORM to pick automatically, or install the plugin that provides it."
    )


def test_a_plugin_is_forced_by_its_entry_point_name_or_its_platform_name(plugins, monkeypatch):
    """The plugin ``vendor-plugin`` provides the platform ``fakevendor``: either name forces it;
    an unavailable match is skipped for an available one of the same name."""
    plugins("vendor-plugin", lambda: _qualname(_PluginPlatform))
    plugins("ghost", lambda: _qualname(_UnavailablePlatform))
    for name in ("vendor-plugin", "fakevendor"):
        platforms.reset_platform()
        monkeypatch.setenv("PIECEWORKS_PLATFORM", name)
        assert platforms.current_platform().name == "fakevendor"
        (probe,) = [p for p in platforms.platform_resolution().probes if p.name == "fakevendor"]
        assert (probe.source, probe.qualname) == (
            "plugin:vendor-plugin",
            _qualname(_PluginPlatform),
        )
    platforms.reset_platform()
    plugins("cpu-too", lambda: _qualname(_UnavailableCpu))  # "cpu", unavailable, probed first
    monkeypatch.setenv("PIECEWORKS_PLATFORM", "cpu")
    assert type(platforms.current_platform()) is CpuPlatform


class _UnavailableCpu(CpuPlatform):
    name = "cpu"

    @classmethod
    def is_available(cls) -> bool:
        return False


def test_an_unavailable_plugin_is_recorded_under_its_platform_name(plugins, monkeypatch):
    monkeypatch.delenv("PIECEWORKS_PLATFORM", raising=False)
    plugins("ghost-plugin", lambda: _qualname(_UnavailablePlatform))
    probes = platforms.platform_resolution().probes
    assert probes[0] == registry.PlatformProbe(
        "ghost",
        "plugin:ghost-plugin",
        False,
        "is_available() returned False",
        _qualname(_UnavailablePlatform),
    )
    assert [p.source for p in probes[1:]] == ["builtin"] * 3  # plugins, then built-ins
    assert platforms.platform_resolution().rule == "probe"


def test_installed_entry_points_are_probed_and_obey_the_allow_list(
    fresh_platform, monkeypatch, caplog
):
    class EntryPoint:
        name = "vendor"

        @staticmethod
        def load():
            return lambda: _qualname(_PluginPlatform)

    groups = []
    monkeypatch.setattr(
        registry, "entry_points", lambda group: groups.append(group) or [EntryPoint]
    )
    monkeypatch.delenv("PIECEWORKS_PLATFORM", raising=False)
    monkeypatch.delenv("PIECEWORKS_PLUGINS", raising=False)
    assert platforms.current_platform().name == "fakevendor"
    assert groups == ["pieceworks.platforms"]
    assert platforms.platform_resolution().rule == "plugin"
    platforms.reset_platform()
    monkeypatch.setenv("PIECEWORKS_PLUGINS", "vendr")  # a typo: warned, and nothing allowed
    monkeypatch.setattr(logging.getLogger("pieceworks"), "propagate", True)
    with caplog.at_level(logging.WARNING, logger="pieceworks"):
        assert platforms.current_platform().name != "fakevendor"
    assert (
        "PIECEWORKS_PLUGINS names 'vendr', but no such plugin is installed (installed: ['vendor'])"
    ) in caplog.text
    platforms.reset_platform()
    monkeypatch.setattr(registry, "entry_points", lambda group: [])
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="pieceworks"):
        platforms.current_platform()
    assert "no such plugin is installed (installed: none)" in caplog.text


def test_a_raising_plugin_is_warned_about_by_name(plugins, monkeypatch, caplog):
    def broken() -> str:
        raise OSError("driver exploded")

    plugins("broken", broken)
    monkeypatch.delenv("PIECEWORKS_PLATFORM", raising=False)
    monkeypatch.setattr(logging.getLogger("pieceworks"), "propagate", True)
    with caplog.at_level(logging.DEBUG, logger="pieceworks"):
        platforms.current_platform()
    warnings = {r.getMessage() for r in caplog.records if r.levelno == logging.WARNING}
    assert warnings == {"platform plugin 'broken' raised while probing: OSError('driver exploded')"}
    (broken_probe,) = [p for p in platforms.platform_resolution().probes if p.name == "broken"]
    assert broken_probe.source == "plugin:broken" and not broken_probe.available
    # The resolution itself is logged at debug level, as `pieceworks platforms` prints it.
    debug = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
    assert platforms.describe_platform_resolution() in debug


def test_unregistering_an_unknown_plugin_is_a_no_op(plugins):
    plugins("fakevendor", lambda: _qualname(_PluginPlatform))
    platforms.unregister_platform_plugin("never-registered")
    platforms.unregister_platform_plugin("fakevendor")
    platforms.unregister_platform_plugin("fakevendor")  # twice: still fine
    assert "fakevendor" not in registry._allowed_plugins()


def test_every_probe_is_recorded_field_by_field(plugins, monkeypatch, caplog):
    """What `pieceworks platforms` and ``platform_resolution().probes`` report, on a CPU-only
    build: a declining, an unavailable, a raising and an available plugin, then the built-ins
    (CUDA raising, ROCm absent, CPU available); each warning in full."""
    from pieceworks.platforms.cuda import CudaPlatform

    def broken() -> str:
        raise OSError("driver exploded")

    def broken_cuda(cls) -> bool:
        raise RuntimeError("no driver")

    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    monkeypatch.setattr(CudaPlatform, "is_available", classmethod(broken_cuda))
    monkeypatch.setenv("PIECEWORKS_PLATFORM", "cpu")
    monkeypatch.setenv("PIECEWORKS_PLUGINS", "shy,ghostly,broken,fake,absent")
    plugins("shy", lambda: None)
    plugins("ghostly", lambda: _qualname(_UnavailablePlatform))
    plugins("broken", broken)
    plugins("fake", lambda: _qualname(_PluginPlatform))
    monkeypatch.setattr(logging.getLogger("pieceworks"), "propagate", True)
    with caplog.at_level(logging.WARNING, logger="pieceworks"):
        platforms.current_platform()
    resolution = platforms.platform_resolution()
    assert (resolution.platform_name, resolution.rule) == ("cpu", "env")
    Probe = registry.PlatformProbe
    assert resolution.probes == [
        Probe("shy", "plugin:shy", False, "plugin declined (returned None)"),
        Probe(
            "ghost",
            "plugin:ghostly",
            False,
            "is_available() returned False",
            _qualname(_UnavailablePlatform),
        ),
        Probe("broken", "plugin:broken", False, "probe raised OSError('driver exploded')"),
        Probe("fakevendor", "plugin:fake", True, "", _qualname(_PluginPlatform)),
        Probe(
            "cuda",
            "builtin",
            False,
            "probe raised RuntimeError('no driver')",
            registry.BUILTIN_PLATFORMS["cuda"],
        ),
        Probe(
            "rocm",
            "builtin",
            False,
            "this torch build is not a ROCm (HIP) build",
            registry.BUILTIN_PLATFORMS["rocm"],
        ),
        Probe("cpu", "builtin", True, "", registry.BUILTIN_PLATFORMS["cpu"]),
    ]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert list(dict.fromkeys(warnings)) == [  # each once (caplog may see a record twice)
        "PIECEWORKS_PLUGINS names 'absent', but no such plugin is installed (installed: "
        "['broken', 'fake', 'ghostly', 'shy'])",
        "platform plugin 'broken' raised while probing: OSError('driver exploded')",
        "probing built-in platform 'cuda' raised: RuntimeError('no driver')",
    ]
