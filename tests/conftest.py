"""Shared fixtures: platform isolation, the static-graph test platform, the GPU marker.

The compile cache is off for the whole session and its root is a temporary directory: no test
reads ``~/.cache`` or depends on what an earlier run left there. The compile-cache tests
(``tests/core/cache/test_compile_cache.py``) turn it on.

Run everything on CPU: ``pytest tests``. GPU tests (``@pytest.mark.gpu``) are skipped unless a
CUDA/ROCm device is visible; on a GPU machine run ``pytest -m gpu tests``.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

# Triton decides at kernel import whether to interpret: on a machine without a GPU, every Triton
# kernel runs under the interpreter (TRITON_INTERPRET=1), so kernel tests run on CPU tensors.
if not torch.cuda.is_available() and "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pieceworks import platforms


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a GPU (CUDA or ROCm); none is visible")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def _compile_cache_off(tmp_path_factory: pytest.TempPathFactory):
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setenv("PIECEWORKS_CACHE_ROOT", str(tmp_path_factory.mktemp("cache_root")))
    monkeypatch.setenv("PIECEWORKS_DISABLE_COMPILE_CACHE", "1")
    yield
    monkeypatch.undo()


@pytest.fixture
def fresh_platform():
    """Forget the resolved platform before and after the test (for env-var driven tests)."""
    platforms.reset_platform()
    yield
    platforms.reset_platform()


@pytest.fixture
def simgraph_platform(monkeypatch: pytest.MonkeyPatch) -> platforms.Platform:
    """The simgraph example platform, whatever this machine has."""
    simgraph = pytest.importorskip(
        "pieceworks_simgraph.platform", reason="pip install -e examples/pieceworks-simgraph"
    )
    platform = simgraph.SimGraphPlatform()
    monkeypatch.setattr(platforms, "_current", platform)
    return platform


@pytest.fixture
def graph_platform(monkeypatch: pytest.MonkeyPatch) -> platforms.Platform:
    """A platform with static graphs: the resolved one if it has them, else simgraph on CPU."""
    platform = platforms.current_platform()
    if not platform.supports_static_graphs():
        simgraph = pytest.importorskip(
            "pieceworks_simgraph.platform", reason="pip install -e examples/pieceworks-simgraph"
        )
        platform = simgraph.SimGraphPlatform()
        monkeypatch.setattr(platforms, "_current", platform)
    return platform
