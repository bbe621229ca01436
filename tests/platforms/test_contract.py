"""The platform contract: versioned, and checked when a platform class is defined.

Proves: a hook name with a typo fails at class definition naming the closest member; a hook with
a wrong signature or kind fails naming the hook and its signature; underscore names and names in
``extra_members`` are free; a plugin stating another major, or a newer minor, contract version is
a resolution error naming both; an older minor resolves; the capability record reflects the
declarations.
Run: pytest tests/platforms/test_contract.py
"""

from __future__ import annotations

import pytest
import torch

from pieceworks import platforms
from pieceworks.platforms import CONTRACT_VERSION, PlatformContractError, registry
from pieceworks.platforms.cpu import CpuPlatform
from pieceworks.platforms.rocm import RocmPlatform


def test_a_misspelt_hook_fails_at_definition_naming_the_closest_member():
    with pytest.raises(PlatformContractError, match="did you mean 'graph_capture'") as error:

        class Typo(CpuPlatform):
            def graph_captur(self, graph, pool, *, skip_gc=False):
                return None

    assert str(error.value).startswith("Typo.graph_captur is not a member of the platform")


def test_a_hook_with_the_wrong_signature_fails_naming_the_hook():
    with pytest.raises(PlatformContractError) as error:

        class Missing(CpuPlatform):
            def graph_capture(self, graph, pool):
                return None

    assert "Missing.graph_capture(self, graph, pool) does not match the contract's hook " in (
        str(error.value)
    )
    assert str(error.value).endswith("keyword parameter 'skip_gc' is missing")
    with pytest.raises(PlatformContractError, match="parameter 1 is 'directory'"):

        class Renamed(CpuPlatform):
            def prepare_kernel_compiler(self, directory):
                return {}

    with pytest.raises(PlatformContractError, match="the contract's is_available is a classm"):

        class NotClassmethod(CpuPlatform):
            def is_available(self):
                return True


def test_private_names_extra_members_and_compatible_overrides_are_free():
    class Fine(CpuPlatform):
        extra_members = ("vendor_knob",)
        vendor_knob = 3
        _helper = 4

        def create_event(self, timing=False, *, flags=0):  # an extra parameter with a default
            return None

        def check_and_update_config(self, config):  # does not call the base class
            pass

    class Child(Fine):
        vendor_knob = 5  # inherited declaration

    assert Child.vendor_knob == 5


@pytest.fixture
def plugin(fresh_platform, monkeypatch):
    monkeypatch.setattr(registry, "entry_points", lambda group: [])
    monkeypatch.delenv("PIECEWORKS_PLATFORM", raising=False)
    yield lambda cls: platforms.register_platform_plugin(
        "versioned", lambda: f"{__name__}.{cls.__name__}"
    )
    platforms.unregister_platform_plugin("versioned")


class NextMajor(CpuPlatform):
    name = "next-major"
    contract_version = (CONTRACT_VERSION[0] + 1, 0)


class NewerMinor(CpuPlatform):
    name = "newer-minor"
    contract_version = (CONTRACT_VERSION[0], CONTRACT_VERSION[1] + 1)


class OlderMinor(CpuPlatform):
    name = "older-minor"
    contract_version = (1, 0)


def test_another_major_version_is_a_resolution_error_naming_both(plugin):
    plugin(NextMajor)
    with pytest.raises(PlatformContractError) as error:
        platforms.current_platform()
    core = f"{CONTRACT_VERSION[0]}.{CONTRACT_VERSION[1]}"
    assert f"platform 'next-major' ({__name__}.NextMajor) implements platform contract " in (
        str(error.value)
    )
    assert f"{CONTRACT_VERSION[0] + 1}.0, this pieceworks implements {core}" in str(error.value)


def test_a_newer_minor_needs_a_newer_pieceworks(plugin):
    plugin(NewerMinor)
    with pytest.raises(PlatformContractError, match="it needs a newer pieceworks"):
        platforms.current_platform()


def test_an_older_minor_resolves(plugin):
    plugin(OlderMinor)
    assert platforms.current_platform().name == "older-minor"


def test_the_capability_record_reads_the_declarations():
    cpu = CpuPlatform().capabilities()
    assert (cpu.static_graphs, cpu.graph_pool_sharing, cpu.breakable_capture) == (
        False,
        False,
        False,
    )
    assert (cpu.dispatch_key, cpu.dist_backend) == ("CPU", "gloo")
    rocm = RocmPlatform().capabilities()
    assert rocm.static_graphs and rocm.breakable_capture and rocm.graph_pool_sharing
    assert rocm.fp8_formats == (torch.float8_e4m3fnuz, torch.float8_e4m3fn)
    assert rocm.dist_backend == "nccl" and rocm.dispatch_key == "CUDA"
