"""Triton's kernel binaries go to pieceworks' cache root unless the user chose a directory.

Proves: with ``TRITON_CACHE_DIR`` unset, building an engine points it at ``triton/`` under the
compile cache root (``CompilationConfig.cache_dir``), so a warm start finds the binaries of
pieceworks' own kernels with the rest of its cache; a directory the user set is kept; with the
compile cache disabled Triton keeps its own default; without a configured cache directory the
root is ``PIECEWORKS_CACHE_ROOT``; the directory chosen is logged at debug level. ``bench
startup`` leaves the variable unset in its runs so the warm run keeps the cold run's binaries.
Run: pytest tests/core/test_triton_cache.py
"""

from __future__ import annotations

import logging
import os

from pieceworks.config import EngineConfig
from pieceworks.core.config import CompilationConfig
from pieceworks.core.triton_cache import use_pieceworks_triton_cache
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
    caplog.set_level(logging.DEBUG, logger="pieceworks.core.triton_cache")
    use_pieceworks_triton_cache(config_with_cache(tmp_path))
    logged = {r.getMessage() for r in caplog.records if r.name == "pieceworks.core.triton_cache"}
    assert logged == {f"Triton kernel binaries: {tmp_path / 'triton'}"}


def test_without_a_configured_directory_the_cache_root_is_used(tmp_path, monkeypatch):
    unset(monkeypatch, "TRITON_CACHE_DIR")
    monkeypatch.delenv("PIECEWORKS_DISABLE_COMPILE_CACHE", raising=False)
    monkeypatch.setenv("PIECEWORKS_CACHE_ROOT", str(tmp_path / "root"))
    path = use_pieceworks_triton_cache(EngineConfig())
    assert path == os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "root" / "triton")
