"""The compile-cache key without compiling: its four factors, the traced files, the directory.

Proves that ``cache_key_factors`` holds exactly the env, config, traced-file and compiler factors
under the names ``cache_key_factors.json`` and the cache-miss report use; that traced files are
named by their path inside their package (an ``__init__.py`` too) and keyed by content; that the
forward's own file is added to what Dynamo recorded, and that a torch without Dynamo's record
gives None (the cache is then off); and that the directory is
``<root>/torch_compile_cache/<hash>/rank_<r>/<prefix>`` with the root and rank from the config.

Run: pytest tests/core/cache/test_cache_key.py
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
from torch._guards import TracingContext

import pieceworks.core
import pieceworks.core.cache.cache_key
import tests.core.toy_model  # noqa: F401  (imported, so named inside its package)
from pieceworks import envs
from pieceworks.config import EngineConfig, ParallelConfig
from pieceworks.core.cache.cache_key import (
    cache_directory,
    cache_key_factors,
    file_digest,
    hash_source_files,
    module_relative_paths,
    traced_source_files,
)
from pieceworks.core.config import CompilationConfig
from pieceworks.utils import hash_factors

REPO_ROOT = Path(__file__).resolve().parents[3]


class FixedCompiler:
    def compute_hash_factors(self) -> dict[str, str]:
        return {"torch": "fixed"}


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_the_key_has_its_five_factors_by_name():
    config = EngineConfig(compilation_config=CompilationConfig(backend="eager"))
    toy = REPO_ROOT / "tests/core/toy_model.py"
    factors = cache_key_factors(config, FixedCompiler(), [str(toy)])
    assert factors == {
        "env": envs.compile_factors(),
        "config": config.compute_factors(),
        "traced_files": {"tests/core/toy_model.py": _sha256(toy)},
        "graph_passes": {
            f"pieceworks/core/passes/{name}.py": _sha256(
                REPO_ROOT / f"pieceworks/core/passes/{name}.py"
            )
            for name in ("graph_match", "head_norm_match", "gemv_fusion", "attn_quant_fusion")
        },
        "compiler": {"torch": "fixed"},
    }


def test_traced_files_are_named_inside_their_package_and_keyed_by_content(tmp_path):
    package_init = Path(pieceworks.core.__file__)
    module = Path(pieceworks.core.cache.cache_key.__file__)
    loose = tmp_path / "loose.py"  # imported under no module name: keeps its absolute path
    loose.write_text("x = 1\n")
    assert hash_source_files([str(package_init), str(module), str(loose)]) == {
        "pieceworks/core/__init__.py": _sha256(package_init),
        "pieceworks/core/cache/cache_key.py": _sha256(module),
        str(loose): _sha256(loose),
    }
    paths = module_relative_paths()
    assert paths[os.path.realpath(module)] == "pieceworks/core/cache/cache_key.py"
    assert paths[os.path.realpath(package_init)] == "pieceworks/core/__init__.py"
    assert all(relative.endswith(".py") for relative in paths.values())


def test_a_file_is_read_once_until_it_changes(tmp_path, monkeypatch):
    source = tmp_path / "pass.py"
    source.write_text("x = 1\n")
    reads = []
    real_open = open
    monkeypatch.setattr(
        "builtins.open", lambda path, *a, **k: (reads.append(path), real_open(path, *a, **k))[1]
    )
    assert file_digest(str(source)) == file_digest(str(source)) == _sha256(source)
    assert len(reads) == 1
    source.write_text("x = 22\n")  # a new size (and modification time): read again
    assert file_digest(str(source)) == _sha256(source)
    assert len(reads) == 2
    assert hash_source_files([str(source)]) == {str(source): _sha256(source)}
    assert len(reads) == 2


def _forward(x):
    return x


def test_the_forward_s_file_is_added_to_what_dynamo_recorded(monkeypatch, tmp_path):
    helper = tmp_path / "helper.py"
    helper.write_text("def helper():\n    return 1\n")
    namespace: dict = {}
    exec(compile(helper.read_text(), str(helper), "exec"), namespace)
    generated = compile("y = 1", "<string>", "exec")  # no file: dropped
    recorded = [namespace["helper"].__code__, generated]
    monkeypatch.setattr(TracingContext, "get_traced_code", staticmethod(lambda: recorded))
    assert traced_source_files() == [str(helper)]
    both = traced_source_files(_forward.__code__)
    assert both == sorted([str(helper), _forward.__code__.co_filename])


def test_no_traced_files_without_dynamo_s_record(monkeypatch):
    monkeypatch.setattr(TracingContext, "get_traced_code", staticmethod(lambda: None))
    assert traced_source_files(_forward.__code__) is None
    monkeypatch.delattr(TracingContext, "get_traced_code")  # a torch that does not record
    assert traced_source_files(_forward.__code__) is None


@pytest.mark.parametrize("prefix, tag", [("backbone", "backbone"), ("", "model"), ("a/b", "a_b")])
def test_the_directory_is_root_hash_rank_prefix(tmp_path, prefix, tag):
    config = EngineConfig(
        compilation_config=CompilationConfig(backend="eager", cache_dir=str(tmp_path)),
        parallel_config=ParallelConfig(tensor_parallel_size=2, rank=1),
    )
    factors = {"config": {"dtype": "float16"}}
    assert cache_directory(config, factors, prefix) == os.path.join(
        str(tmp_path), "torch_compile_cache", hash_factors(factors), "rank_1", tag
    )


def test_the_root_is_the_config_s_cache_dir_or_the_env_cache_root_home_expanded(monkeypatch):
    factors = {"env": {}}
    tail = ("torch_compile_cache", hash_factors(factors), "rank_0", "model")
    home = EngineConfig(compilation_config=CompilationConfig(backend="eager", cache_dir="~/pw"))
    assert cache_directory(home, factors, "model") == os.path.join(
        os.path.expanduser("~/pw"), *tail
    )
    monkeypatch.setenv("PIECEWORKS_CACHE_ROOT", "/tmp/pieceworks-env-root")
    default = EngineConfig(compilation_config=CompilationConfig(backend="eager"))
    assert cache_directory(default, factors, "model") == os.path.join(
        "/tmp/pieceworks-env-root", *tail
    )
