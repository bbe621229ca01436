"""``CompilerManager``: compile each distinct piece once, through the on-disk compile cache.

Between ``PiecewiseBackend`` and a ``CompilerInterface``. For a compiler that saves artifacts
(Inductor), a piece compiled for a shape is, in order: the runnable of a structurally identical
piece already built in this model (same ``artifact_key``), the artifact its index entry names on
disk (loaded, not compiled), or a fresh compile that is then saved. Nothing enters a disk cache
when ``cache`` is None (disabled), but identical pieces still share one compile.

The eager compiler has nothing to cache or share: its "artifact" is the piece's own FX graph,
built for free. It goes straight to the compiler, so ``num_eager_compiles`` counts every piece and
shape as before, and the save/load counters stay 0.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.fx
from torch._subclasses.fake_tensor import unset_fake_temporarily

from pieceworks.core.cache.artifact_key import artifact_key
from pieceworks.core.cache.compile_cache import CompileCache
from pieceworks.core.compiler_interface import CompilerInterface
from pieceworks.core.counters import compilation_counter
from pieceworks.logger import init_logger

logger = init_logger(__name__)


def entry_name(piece_index: int, runtime_shape: int | None) -> str:
    """The index entry of one piece and shape: ``piece_3/general`` or ``piece_3/size_8``."""
    shape = "general" if runtime_shape is None else f"size_{runtime_shape}"
    return f"piece_{piece_index}/{shape}"


class CompilerManager:
    """One model's compiles: shared between identical pieces, loaded from or saved to the cache."""

    def __init__(self, compiler: CompilerInterface, cache: CompileCache | None) -> None:
        self.compiler = compiler
        self.cache = cache
        self.runnables: dict[str, Callable[..., Any]] = {}  # artifact key -> compiled piece
        self.unloadable: set[str] = set()  # keys whose intact-looking artifact failed to load

    def compile(
        self,
        graph: torch.fx.GraphModule,
        example_inputs: list[Any],
        options: dict[str, Any],
        piece_index: int,
        runtime_shape: int | None,
        key: str | None = None,
    ) -> Callable[..., Any]:
        """The runnable of ``graph`` for ``runtime_shape``, compiled only if it must be.
        ``key`` is the piece's artifact key when known (a warm start's graph has no example
        values to hash)."""
        if not self.compiler.saves_artifacts:
            return self.compiler.compile(graph, example_inputs, options, runtime_shape)
        key = key or artifact_key(graph, runtime_shape, piece_index)
        entry = entry_name(piece_index, runtime_shape)
        runnable = self.runnables.get(key)
        if runnable is None:
            runnable = self._load(entry, key, graph)
        if runnable is None:
            runnable = self.compiler.compile(graph, example_inputs, options, runtime_shape)
            self._save(entry, key, runnable)
        elif self.cache is not None:
            self.cache.record(entry, key)
        self.runnables[key] = runnable
        return runnable

    def load(
        self, graph: torch.fx.GraphModule, piece_index: int, runtime_shape: int | None, key: str
    ) -> Callable[..., Any] | None:
        """The runnable of an artifact the cache holds under ``key``; None when it is absent or
        unusable (warned). The eager compiler's runnable is the graph itself."""
        if not self.compiler.saves_artifacts:
            return self.compiler.compile(graph, [], {}, runtime_shape)
        runnable = self.runnables.get(key)
        if runnable is None:
            runnable = self._load(entry_name(piece_index, runtime_shape), key, graph)
        if runnable is not None:
            self.runnables[key] = runnable
        return runnable

    def _load(self, entry: str, key: str, graph: torch.fx.GraphModule) -> Callable[..., Any] | None:
        """The artifact of ``entry`` from disk; None when absent or unusable (warned)."""
        path = self.cache.lookup(entry, key) if self.cache is not None else None
        if path is None:
            return None
        try:
            with unset_fake_temporarily():  # the backend runs pieces under fake tensors
                runnable = self.compiler.load_artifact(path, graph)
        except Exception as error:  # a damaged artifact surfaces as any error of the loader
            assert self.cache is not None
            self.cache.warn_corrupt(entry, f"loading failed: {error!r}")
            self.unloadable.add(key)
            return None
        compilation_counter.num_compiled_artifacts_loaded += 1
        return runnable

    def _save(self, entry: str, key: str, runnable: Callable[..., Any]) -> None:
        if self.cache is None:
            return
        try:
            self.cache.store(
                entry,
                key,
                lambda path: self.compiler.save_artifact(runnable, path),
                replace=key in self.unloadable,
            )
        except Exception as error:  # an unsaveable graph must not stop the model from running
            logger.warning(
                "compile cache: could not save %s (%r); it will be compiled again next run",
                entry,
                error,
            )
