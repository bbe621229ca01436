"""Triton's kernel binaries go to pieceworks' cache root unless the user chose a directory.

Proves: with ``TRITON_CACHE_DIR`` unset, building an engine points it at ``triton/`` under the
compile cache root (``CompilationConfig.cache_dir``), so a warm start finds the binaries of
pieceworks' own kernels with the rest of its cache; a directory the user set is kept; with the
compile cache disabled Triton keeps its own default; without a configured cache directory the
root is ``PIECEWORKS_CACHE_ROOT``; the directory chosen is logged at debug level. ``bench
startup`` leaves the variable unset in its runs so the warm run keeps the cold run's binaries.
``TRITON_PTXAS_PATH`` is pointed at torch's own executable ``bin/ptxas`` (Inductor's choice,
which keys every binary) unless the user set it or torch has none, and both are set before the
engine loads its model.
Run: pytest tests/core/cache/test_triton_cache.py
"""

from __future__ import annotations

import logging
import os

from pieceworks.config import EngineConfig
from pieceworks.core.cache.triton_cache import use_pieceworks_triton_cache, use_torch_ptxas
from pieceworks.core.config import CompilationConfig
from pieceworks.engine.llm import LLM


def unset(monkeypatch, name: str) -> None:
    """Unset ``name`` for the test and restore it after, also when the code under test sets it
    (``delenv`` of an unset variable records nothing to restore)."""
    monkeypatch.setenv(name, "")
    monkeypatch.delenv(name)


def config_with_cache(cache_dir) -> EngineConfig:
    return EngineConfig(compilation_config=CompilationConfig(cache_dir=str(cache_dir)))


def test_unset_points_triton_under_the_cache_root(tmp_path, monkeypatch):
    unset(monkeypatch, "TRITON_CACHE_DIR")
    monkeypatch.delenv("PIECEWORKS_DISABLE_COMPILE_CACHE", raising=False)
    path = use_pieceworks_triton_cache(config_with_cache(tmp_path))
    assert path == os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "triton")


def test_a_directory_the_user_set_is_kept(tmp_path, monkeypatch):
    monkeypatch.delenv("PIECEWORKS_DISABLE_COMPILE_CACHE", raising=False)  # the cache on
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "mine"))
    assert use_pieceworks_triton_cache(config_with_cache(tmp_path)) is None
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "mine")


def test_a_disabled_compile_cache_leaves_triton_alone(tmp_path, monkeypatch):
    unset(monkeypatch, "TRITON_CACHE_DIR")
    monkeypatch.setenv("PIECEWORKS_DISABLE_COMPILE_CACHE", "1")
    assert use_pieceworks_triton_cache(config_with_cache(tmp_path)) is None
    assert "TRITON_CACHE_DIR" not in os.environ


def test_building_an_engine_sets_it_before_the_model_loads(tmp_path, monkeypatch):
    unset(monkeypatch, "TRITON_CACHE_DIR")
    monkeypatch.delenv("PIECEWORKS_DISABLE_COMPILE_CACHE", raising=False)
    llm = LLM("llama-tiny", enforce_eager=True, compilation_config={"cache_dir": str(tmp_path)})
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "triton")
    llm.shutdown()


def test_the_directory_is_logged_at_debug(tmp_path, monkeypatch, caplog):
    unset(monkeypatch, "TRITON_CACHE_DIR")
    monkeypatch.delenv("PIECEWORKS_DISABLE_COMPILE_CACHE", raising=False)
    monkeypatch.setattr(logging.getLogger("pieceworks"), "propagate", True)
    caplog.set_level(logging.DEBUG, logger="pieceworks.core.cache.triton_cache")
    use_pieceworks_triton_cache(config_with_cache(tmp_path))
    logged = {
        r.getMessage() for r in caplog.records if r.name == "pieceworks.core.cache.triton_cache"
    }
    assert logged == {f"Triton kernel binaries: {tmp_path / 'triton'}"}


def test_without_a_configured_directory_the_cache_root_is_used(tmp_path, monkeypatch):
    unset(monkeypatch, "TRITON_CACHE_DIR")
    monkeypatch.delenv("PIECEWORKS_DISABLE_COMPILE_CACHE", raising=False)
    monkeypatch.setenv("PIECEWORKS_CACHE_ROOT", str(tmp_path / "root"))
    path = use_pieceworks_triton_cache(EngineConfig())
    assert path == os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "root" / "triton")


def fake_torch_dir(tmp_path, mode: int = 0o755):
    """A directory laid out as torch's, with a ``bin/ptxas`` of file mode ``mode``."""
    ptxas = tmp_path / "torch" / "bin" / "ptxas"
    ptxas.parent.mkdir(parents=True)
    ptxas.write_text("#!/bin/sh\n")
    ptxas.chmod(mode)
    return str(tmp_path / "torch"), str(ptxas)


def test_triton_assembles_with_torch_s_ptxas_and_says_so_at_debug(tmp_path, monkeypatch, caplog):
    unset(monkeypatch, "TRITON_PTXAS_PATH")
    monkeypatch.setattr(logging.getLogger("pieceworks"), "propagate", True)
    caplog.set_level(logging.DEBUG, logger="pieceworks.core.cache.triton_cache")
    torch_dir, ptxas = fake_torch_dir(tmp_path)
    assert use_torch_ptxas(torch_dir) == os.environ["TRITON_PTXAS_PATH"] == ptxas
    logged = {
        (r.levelno, r.getMessage())
        for r in caplog.records
        if r.name == "pieceworks.core.cache.triton_cache"
    }
    assert logged == {(logging.DEBUG, f"Triton assembles with torch's ptxas: {ptxas}")}


def test_a_ptxas_the_user_set_is_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_PTXAS_PATH", "/opt/cuda/bin/ptxas")
    torch_dir, _ = fake_torch_dir(tmp_path)
    assert use_torch_ptxas(torch_dir) is None
    assert os.environ["TRITON_PTXAS_PATH"] == "/opt/cuda/bin/ptxas"


def test_a_torch_without_an_executable_ptxas_changes_nothing(tmp_path, monkeypatch):
    unset(monkeypatch, "TRITON_PTXAS_PATH")
    assert use_torch_ptxas(str(tmp_path / "no-torch")) is None  # CPU and ROCm builds
    torch_dir, _ = fake_torch_dir(tmp_path, mode=0o644)
    assert use_torch_ptxas(torch_dir) is None
    assert "TRITON_PTXAS_PATH" not in os.environ


def test_the_installed_torch_s_ptxas_is_the_default(tmp_path, monkeypatch):
    import torch

    unset(monkeypatch, "TRITON_PTXAS_PATH")
    torch_dir, ptxas = fake_torch_dir(tmp_path)
    monkeypatch.setattr(torch, "__file__", os.path.join(torch_dir, "__init__.py"))
    assert use_torch_ptxas() == ptxas


def test_building_an_engine_sets_both_before_the_model_loads(tmp_path, monkeypatch):
    from pieceworks.worker import model_runner

    calls = []
    monkeypatch.setattr(model_runner, "use_torch_ptxas", lambda: calls.append("ptxas"))
    monkeypatch.setattr(
        model_runner, "use_pieceworks_triton_cache", lambda config: calls.append("cache")
    )
    load = model_runner.get_model
    monkeypatch.setattr(
        model_runner, "get_model", lambda *args: (calls.append("model"), load(*args))[1]
    )
    LLM(
        "llama-tiny", enforce_eager=True, compilation_config={"cache_dir": str(tmp_path)}
    ).shutdown()
    assert calls == ["cache", "ptxas", "model"]
