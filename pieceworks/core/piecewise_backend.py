"""``PiecewiseBackend``: the compiled code of one capturable piece, chosen by token count.

It holds the dynamic-shape compile, built when the graph is split, and one static compile per
``compile_sizes`` entry, built the first time that token count is seen (with real inputs, so
autotuning measures real kernels). Compiles go through the model's ``CompilerManager``, which may
share them with identical pieces or load them from the compile cache. It compiles; it never
captures: that is the wrapper's job.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch.fx

from pieceworks.core.compiler_manager import CompilerManager
from pieceworks.core.counters import compilation_counter
from pieceworks.logger import init_logger

if TYPE_CHECKING:
    from pieceworks.config import EngineConfig

logger = init_logger(__name__)


class PiecewiseBackend:
    """Compiled runnables of one piece: dynamic shape plus static ``compile_sizes``."""

    def __init__(
        self,
        graph: torch.fx.GraphModule,
        config: EngineConfig,
        piece_index: int,
        num_pieces: int,
        sym_shape_indices: list[int],
        compiler: CompilerManager,
        example_inputs: list[Any] | None = None,
        *,
        compiled_general: Callable[..., Any] | None = None,
        artifact_keys: dict[int | None, str] | None = None,
    ) -> None:
        """Compiles the dynamic shape from ``example_inputs``, or takes ``compiled_general``
        (a warm start's loaded artifact, whose ``artifact_keys`` the traced start computed)."""
        self.graph = graph
        self.piece_index = piece_index
        self.num_pieces = num_pieces
        self.sym_shape_indices = sym_shape_indices
        self.compiler = compiler
        self.options = config.compilation_config.inductor_compile_config
        self.compile_sizes = set(config.compilation_config.compile_sizes)
        self.artifact_keys = artifact_keys or {}
        if compiled_general is None:
            assert example_inputs is not None, "compiling needs the piece's example inputs"
            compiled_general = compiler.compile(
                graph, example_inputs, self.options, piece_index, None
            )
        self.compiled_general = compiled_general
        self.static_runnables: dict[int, Callable[..., Any]] = {}
        compilation_counter.num_backend_compilations += 1

    def runtime_shape(self, args: tuple) -> int | None:
        """The token count of this call (the first symbolic-shape argument)."""
        if not self.sym_shape_indices:
            return None
        return int(args[self.sym_shape_indices[0]])

    def __call__(self, *args: Any) -> Any:
        runtime_shape = self.runtime_shape(args)
        if runtime_shape is None or runtime_shape not in self.compile_sizes:
            return self.compiled_general(*args)
        runnable = self.static_runnables.get(runtime_shape)
        if runnable is None:
            logger.debug(
                "compiling piece %d/%d for static size %d",
                self.piece_index + 1,
                self.num_pieces,
                runtime_shape,
            )
            runnable = self.compiler.compile(
                self.graph,
                list(args),
                self.options,
                self.piece_index,
                runtime_shape,
                key=self.artifact_keys.get(runtime_shape),
            )
            self.static_runnables[runtime_shape] = runnable
        return runnable(*args)
