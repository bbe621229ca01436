"""Programmatic dependent launch: the platform decides, PIECEWORKS_PDL overrides, Inductor follows.

Run: pytest tests/kernels/test_programmatic_launch.py
"""

from __future__ import annotations

import logging

import pytest
import torch

from pieceworks.engine.arg_utils import build_engine_config
from pieceworks.kernels import programmatic_launch as pdl
from pieceworks.kernels import triton_device, triton_launch
from pieceworks.kernels.programmatic_launch import inductor_launch_options
from pieceworks.platforms import current_platform
from pieceworks.platforms.capability import PROGRAMMATIC_LAUNCH, TRITON, DeviceCapability


def with_capability(monkeypatch, platform: type, features: set[str]) -> None:
    """``platform``'s device, for the test, has exactly ``features``."""
    capability = DeviceCapability(vendor="test", features=frozenset(features))
    monkeypatch.setattr(platform, "device_capability", lambda self: capability)


@pytest.fixture
def platform_with_pdl(monkeypatch):
    """The current platform, claiming programmatic launch; the decision re-resolved after."""
    platform = type(current_platform())
    with_capability(monkeypatch, platform, {PROGRAMMATIC_LAUNCH})
    pdl.programmatic_launch_enabled.cache_clear()
    yield platform
    pdl.programmatic_launch_enabled.cache_clear()


def _decide(monkeypatch, value: str | None) -> bool:
    if value is None:
        monkeypatch.delenv("PIECEWORKS_PDL", raising=False)
    else:
        monkeypatch.setenv("PIECEWORKS_PDL", value)
    pdl.programmatic_launch_enabled.cache_clear()
    return pdl.programmatic_launch_enabled()


def test_the_variable_overrides_the_default_where_supported(monkeypatch, platform_with_pdl):
    assert _decide(monkeypatch, None) is pdl.PDL_BY_DEFAULT
    assert _decide(monkeypatch, "0") is False
    assert _decide(monkeypatch, "1") is True


def test_the_variable_cannot_force_it_and_says_so(monkeypatch, platform_with_pdl, caplog):
    with_capability(monkeypatch, platform_with_pdl, set())
    with caplog.at_level(logging.WARNING, logger="pieceworks"):
        assert _decide(monkeypatch, "1") is False
    assert "PIECEWORKS_PDL=1 is ignored" in caplog.text
    assert _decide(monkeypatch, None) is False


def test_kernels_use_it_only_where_they_run_compiled(monkeypatch, platform_with_pdl):
    """On the platform's own device where it runs pieceworks' Triton kernels, not interpreted;
    never on another device (the CPU on a GPU platform) nor where the platform runs none."""
    _decide(monkeypatch, "1")
    with_capability(monkeypatch, platform_with_pdl, {PROGRAMMATIC_LAUNCH, TRITON})
    own = torch.device(current_platform().device_type)
    assert triton_launch.programmatic_launch(own) is not triton_device.INTERPRETED
    assert triton_launch.programmatic_launch(torch.device("meta")) is False
    with_capability(monkeypatch, platform_with_pdl, {PROGRAMMATIC_LAUNCH})
    assert triton_launch.programmatic_launch(own) is False
    assert triton_launch.launch_options(True) == {"launch_pdl": True}
    assert triton_launch.launch_options(False) == {}


def test_inductor_kernels_follow_the_decision(monkeypatch, platform_with_pdl):
    from torch._inductor import config as inductor_config

    _decide(monkeypatch, "0")
    assert inductor_launch_options() == {}
    _decide(monkeypatch, "1")
    expected = {"triton.enable_pdl": True} if hasattr(inductor_config.triton, "enable_pdl") else {}
    assert inductor_launch_options() == expected
    engine_config = build_engine_config("llama-tiny", {"level": 3})
    assert engine_config.compilation_config.inductor_compile_config == expected
    user_config = {"level": 3, "inductor_compile_config": {"triton.enable_pdl": False}}
    engine_config = build_engine_config("llama-tiny", user_config)
    assert engine_config.compilation_config.inductor_compile_config == {"triton.enable_pdl": False}


def test_the_variable_enters_the_compile_cache_key(monkeypatch):
    from pieceworks import envs

    monkeypatch.setenv("PIECEWORKS_PDL", "1")
    on = envs.compile_factors()
    monkeypatch.setenv("PIECEWORKS_PDL", "0")
    assert envs.compile_factors() != on
