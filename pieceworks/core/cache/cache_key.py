"""The compile-cache key: what it hashes, and the cache directory it names.

The key covers everything that changes the code compiled for a model: pieceworks' env factors
(``envs.compile_factors()``), the config fields ``EngineConfig.compute_hash()`` covers, the contents
of every source file Dynamo traced (the forward and every function it inlined) and the compiler's
own factors (torch and Inductor config, ...). A traced file is named by its path inside its package
(``pieceworks/models/llama.py``, ``torch/nn/modules/linear.py``), taken from the module it was
imported as, never by where it is installed: the same software installed under another path, or a
cache directory copied to another machine, keys the same. A file imported under no module name (code
loaded from a path) keeps its absolute path. Dynamo itself records the code objects it traces in the
active ``TracingContext``, so no patch is needed; the record is complete only once tracing ended, so
the cache directory is decided inside the backend call, when the graph arrives. The factors are
written beside the artifacts as ``cache_key_factors.json``. Storage is ``compile_cache.py``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Collection
from types import CodeType
from typing import TYPE_CHECKING, Any

from pieceworks.utils import file_digest, hash_factors

if TYPE_CHECKING:
    from pieceworks.config import EngineConfig
    from pieceworks.core.compiler_interface import CompilerInterface


def traced_source_files(forward_code: CodeType | None = None) -> list[str] | None:
    """Source files of the code Dynamo traced for the graph being compiled; None if unknown.

    Dynamo's ``TracingContext.traced_code`` holds the traced frame and every function it inlined
    (helpers included); ``forward_code`` is added in case a torch version leaves the frame out.
    """
    from torch._guards import TracingContext

    get_traced_code = getattr(TracingContext, "get_traced_code", None)  # absent in old torch
    codes = get_traced_code() if get_traced_code is not None else None
    if codes is None:
        return None
    files = {code.co_filename for code in codes}
    if forward_code is not None:
        files.add(forward_code.co_filename)
    return sorted(path for path in files if os.path.isfile(path))  # drops "<string>", "<eval...>"


def module_files() -> list[tuple[str, str]]:
    """(file as imported, path inside its package) of every imported module with a ``.py`` file."""
    files = []
    for name, module in list(sys.modules.items()):
        file = getattr(module, "__file__", None)
        if not isinstance(file, str) or not file.endswith(".py"):
            continue
        stem = name.replace(".", "/")
        relative = f"{stem}/__init__.py" if file.endswith("__init__.py") else f"{stem}.py"
        files.append((file, relative))
    return files


def module_relative_paths(file_names: Collection[str] | None = None) -> dict[str, str]:
    """Real path of every imported module's file -> its path inside its package; with
    ``file_names``, only the files of those base names (resolving a real path is a few system
    calls per module, and a process has imported thousands)."""
    return {
        os.path.realpath(file): relative
        for file, relative in module_files()
        if file_names is None or os.path.basename(file) in file_names
    }


def hash_source_files(paths: list[str]) -> dict[str, str]:
    """Package-relative path (absolute outside any module) -> SHA-256 of the file's contents."""
    relative_paths = module_relative_paths({os.path.basename(path) for path in paths})
    return {relative_paths.get(os.path.realpath(path), path): file_digest(path) for path in paths}


def cache_key_factors(
    config: EngineConfig, compiler: CompilerInterface, traced_files: list[str]
) -> dict[str, Any]:
    """Every factor of the cache key, JSON-ready (the hash of this dict names the directory)."""
    from pieceworks import envs
    from pieceworks.core.passes import attn_quant_fusion, gemv_fusion, graph_match, head_norm_match

    return {
        "env": envs.compile_factors(),
        "config": config.compute_factors(),  # what EngineConfig.compute_hash() hashes
        "traced_files": hash_source_files(traced_files),
        # the passes that rewrite Dynamo's graph before it is split (not traced by Dynamo)
        "graph_passes": hash_source_files(
            [
                str(module.__file__)
                for module in (graph_match, head_norm_match, gemv_fusion, attn_quant_fusion)
            ]
        ),
        "compiler": compiler.compute_hash_factors(),
    }


def cache_directory(config: EngineConfig, factors: dict[str, Any], prefix: str) -> str:
    """``<cache_root>/torch_compile_cache/<hash>/rank_<r>/<prefix>``."""
    from pieceworks import envs

    root = config.compilation_config.cache_dir or envs.PIECEWORKS_CACHE_ROOT
    rank = config.parallel_config.rank
    model_tag = (prefix or "model").replace(os.sep, "_")
    return os.path.join(
        os.path.expanduser(root),
        "torch_compile_cache",
        hash_factors(factors),
        f"rank_{rank}",
        model_tag,
    )
