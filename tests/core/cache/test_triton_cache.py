"""Triton's kernel binaries go to pieceworks' cache root unless the user chose a directory.

Proves: with ``TRITON_CACHE_DIR`` unset, building an engine points it at ``triton/`` under the
compile cache root (``CompilationConfig.cache_dir``), so a warm start finds the binaries of
pieceworks' own kernels with the rest of its cache; a directory the user set is kept; with the
compile cache disabled Triton keeps its own default; without a configured cache directory the
root is ``PIECEWORKS_CACHE_ROOT``; the directory chosen is logged at debug level. ``bench
startup`` leaves the variable unset in its runs so the warm run keeps the cold run's binaries.
On CUDA the platform's ``prepare_kernel_compiler`` points ``TRITON_PTXAS_PATH`` at torch's own
executable ``bin/ptxas`` (Inductor's choice, which keys every binary) unless the user set it or
torch has none; ROCm never names it; and engine start-up sets them before the model loads.
Run: pytest tests/core/cache/test_triton_cache.py
"""

from __future__ import annotations

import logging
import os

from pieceworks.config import EngineConfig
from pieceworks.core.cache.triton_cache import (
    kernel_compiler_environment,
    use_kernel_compiler_environment,
)
from pieceworks.core.config import CompilationConfig
from pieceworks.engine.llm import LLM
from pieceworks.platforms.cuda import CudaPlatform, torch_ptxas
from pieceworks.platforms.rocm import RocmPlatform


def use_pieceworks_triton_cache(config: EngineConfig) -> str | None:
    """What start-up sets ``TRITON_CACHE_DIR`` to on the current platform (None: left alone)."""
    return use_kernel_compiler_environment(config).get("TRITON_CACHE_DIR")


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


def with_torch_dir(monkeypatch, torch_dir: str) -> None:
    """The installed torch appears to live in ``torch_dir``."""
    import torch

    monkeypatch.setattr(torch, "__file__", os.path.join(torch_dir, "__init__.py"))


def test_cuda_assembles_with_torch_s_ptxas_and_says_so_at_debug(tmp_path, monkeypatch, caplog):
    unset(monkeypatch, "TRITON_PTXAS_PATH")
    monkeypatch.setattr(logging.getLogger("pieceworks"), "propagate", True)
    caplog.set_level(logging.DEBUG, logger="pieceworks.platforms.cuda")
    torch_dir, ptxas = fake_torch_dir(tmp_path)
    with_torch_dir(monkeypatch, torch_dir)
    cache = str(tmp_path / "triton")
    assert CudaPlatform().prepare_kernel_compiler(cache) == {
        "TRITON_CACHE_DIR": cache,
        "TRITON_PTXAS_PATH": ptxas,
    }
    logged = {
        (r.levelno, r.getMessage()) for r in caplog.records if r.name == "pieceworks.platforms.cuda"
    }
    assert logged == {(logging.DEBUG, f"Triton assembles with torch's ptxas: {ptxas}")}
    assert "TRITON_PTXAS_PATH" not in os.environ  # the hook only says what to set


def test_a_ptxas_the_user_set_is_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_PTXAS_PATH", "/opt/cuda/bin/ptxas")
    torch_dir, _ = fake_torch_dir(tmp_path)
    with_torch_dir(monkeypatch, torch_dir)
    environment = kernel_compiler_environment(config_with_cache(tmp_path), CudaPlatform())
    assert "TRITON_PTXAS_PATH" not in environment
    assert os.environ["TRITON_PTXAS_PATH"] == "/opt/cuda/bin/ptxas"


def test_a_torch_without_an_executable_ptxas_changes_nothing(tmp_path, monkeypatch):
    unset(monkeypatch, "TRITON_PTXAS_PATH")
    assert torch_ptxas(str(tmp_path / "no-torch")) is None  # CPU and ROCm builds
    torch_dir, _ = fake_torch_dir(tmp_path, mode=0o644)
    assert torch_ptxas(torch_dir) is None
    with_torch_dir(monkeypatch, torch_dir)
    assert "TRITON_PTXAS_PATH" not in CudaPlatform().prepare_kernel_compiler(None)


def test_the_installed_torch_s_ptxas_is_the_default(tmp_path, monkeypatch):
    torch_dir, ptxas = fake_torch_dir(tmp_path)
    with_torch_dir(monkeypatch, torch_dir)
    assert torch_ptxas() == ptxas


def test_rocm_never_names_ptxas(tmp_path, monkeypatch):
    torch_dir, _ = fake_torch_dir(tmp_path)
    with_torch_dir(monkeypatch, torch_dir)
    assert RocmPlatform().prepare_kernel_compiler("dir") == {"TRITON_CACHE_DIR": "dir"}


def test_building_an_engine_sets_both_before_the_model_loads(tmp_path, monkeypatch):
    from pieceworks.worker import executor, model_runner

    calls = []
    set_up = executor.use_kernel_compiler_environment
    monkeypatch.setattr(
        executor,
        "use_kernel_compiler_environment",
        lambda config: (calls.append("compiler"), set_up(config))[1],
    )
    load = model_runner.get_model
    monkeypatch.setattr(
        model_runner, "get_model", lambda *args: (calls.append("model"), load(*args))[1]
    )
    LLM(
        "llama-tiny", enforce_eager=True, compilation_config={"cache_dir": str(tmp_path)}
    ).shutdown()
    assert calls == ["compiler", "model"]
