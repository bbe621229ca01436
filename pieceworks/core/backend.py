"""``PiecewiseCompileBackend``: the Dynamo backend of level 3 (split, compile each piece, wrap).

Dynamo hands it the whole traced graph once. It runs the epilogue fusions on it
(``core/passes/gemv_fusion.py``, ``attn_quant_fusion.py``), opens the compile cache (its directory
hashes the files Dynamo just traced, so it is decided here), splits the graph at the splitting
ops, runs the stitched module once on fake tensors to learn each piece's example inputs, compiles
every capturable piece into a ``PiecewiseBackend``, and wraps each in the platform's static-graph
wrapper when the graph mode captures pieces. The stitched module is what later calls run.

A warm start (``warm_start.py``) hands it the stored split graph (fused before it was split)
instead: ``rebuild`` opens the same cache, loads each capturable piece's artifact and wraps the
pieces the same way, with no graph from Dynamo and no compile.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from types import CodeType
from typing import TYPE_CHECKING, Any

import torch
import torch.fx
from torch._dispatch.python import enable_python_dispatcher
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensorMode

from pieceworks.core.cache.artifact_key import artifact_key
from pieceworks.core.cache.cache_key import cache_directory, cache_key_factors, traced_source_files
from pieceworks.core.cache.cache_miss import explain_miss
from pieceworks.core.cache.compile_cache import CompileCache
from pieceworks.core.compiler_interface import make_compiler
from pieceworks.core.compiler_manager import CompilerManager, entry_name
from pieceworks.core.config import CUDAGraphMode
from pieceworks.core.counters import compilation_counter
from pieceworks.core.graph_call import source_name
from pieceworks.core.passes.gemv_fusion import fuse_epilogues
from pieceworks.core.piecewise_backend import PiecewiseBackend
from pieceworks.core.split import split_graph
from pieceworks.core.splitting_call import bind_splitting_calls
from pieceworks.core.static_graph import CUDAGraphOptions, StaticGraphWrapperBase
from pieceworks.core.static_inputs import StaticInputCopier, dynamic_input_indices
from pieceworks.core.warm_start.traced_graph_store import TracedGraphDamaged
from pieceworks.logger import init_logger
from pieceworks.platforms import current_platform

if TYPE_CHECKING:
    from pieceworks.config import EngineConfig

logger = init_logger(__name__)


class PiecewiseCompileInterpreter(torch.fx.Interpreter):
    """Runs the split module on fake inputs and replaces each capturable piece as it is reached."""

    def __init__(
        self,
        module: torch.fx.GraphModule,
        compile_submod_names: list[str],
        config: EngineConfig,
        compiler: CompilerManager,
        fake_mode: FakeTensorMode,
        wrappers: list[StaticGraphWrapperBase],
    ) -> None:
        super().__init__(module)
        self.compile_submod_names = compile_submod_names
        self.config = config
        self.compiler = compiler
        self.fake_mode = fake_mode
        self.piece_records: list[dict[str, Any]] = []  # what a warm start needs of each piece
        self.wrappers = wrappers  # every static-graph wrapper built, in piece order

    def run(self, *args: Any) -> Any:  # type: ignore[override]
        fake_args = [
            self.fake_mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args
        ]
        with self.fake_mode, enable_python_dispatcher():
            return super().run(*fake_args)

    def call_module(self, target: Any, args: tuple, kwargs: dict) -> Any:
        shape_env = self.fake_mode.shape_env
        # A piece whose op returns a data-dependent size (a fake impl's ``new_dynamic_size()``)
        # makes a fresh unbacked symbol each time it runs on fake tensors. Dynamo bound it when
        # it traced; left pending here, Inductor's compile of the next piece, under this shape
        # environment, would look for its binding and fail (PendingUnbackedSymbolNotFound).
        ignore = shape_env.ignore_fresh_unbacked_symbols() if shape_env else nullcontext()
        with ignore:
            output = super().call_module(target, args, kwargs)
        if target in self.compile_submod_names:
            index = self.compile_submod_names.index(target)
            submod = self.fetch_attr(target)
            sym_shape_indices = [i for i, a in enumerate(args) if isinstance(a, torch.SymInt)]
            backend = PiecewiseBackend(
                submod,
                self.config,
                index,
                len(self.compile_submod_names),
                sym_shape_indices,
                self.compiler,
                list(args),
            )
            # Replace the submodule on the instance: the stitched forward calls self.<target>.
            num_pieces = len(self.compile_submod_names)
            self.module.__dict__[target] = wrap_piece(
                backend, index, num_pieces, self.config, self.wrappers
            )
            self.piece_records.append(piece_record(target, backend))
        return output


def piece_record(submod_name: str, backend: PiecewiseBackend) -> dict[str, Any]:
    """Index, symbolic-size argument positions and artifact keys (dynamic shape: ``None``, and
    every ``compile_sizes`` entry) of one capturable piece."""
    sizes = [None, *sorted(backend.compile_sizes)]
    return {
        "submod_name": submod_name,
        "index": backend.piece_index,
        "sym_shape_indices": backend.sym_shape_indices,
        "artifact_keys": {
            size: artifact_key(backend.graph, size, backend.piece_index) for size in sizes
        },
    }


def wrap_piece(
    backend: PiecewiseBackend, index: int, num_pieces: int, config: EngineConfig,
    wrappers: list[StaticGraphWrapperBase],
) -> Callable[..., Any]:  # fmt: skip
    """The piece in the platform's static-graph wrapper when the graph mode captures pieces; the
    wrapper joins ``wrappers`` (a vendor's own wrapper class keeps its own books)."""
    mode = config.compilation_config.cudagraph_mode
    assert mode is not None
    if not mode.has_piecewise_cudagraphs():
        return backend
    options = CUDAGraphOptions(
        debug_log_enable=index == 0,
        gc_disable=index != 0,  # gc once per step's capture, in the first piece only
        weak_ref_output=index == num_pieces - 1,  # nothing reads the last piece's output
    )
    wrapper_cls = current_platform().static_graph_wrapper_cls()
    wrapper = wrapper_cls(backend, config, CUDAGraphMode.PIECEWISE, options=options)
    if isinstance(wrapper, StaticGraphWrapperBase):
        wrappers.append(wrapper)
    return wrapper


class FirstCallRecorder:
    """Runs the stitched module; keeps what its first call got and returned (the warm start's
    ``GraphCall`` is made from them) until ``release``."""

    def __init__(self, runnable: Callable[..., Any]) -> None:
        self.runnable = runnable
        self.inputs: tuple | None = None
        self.outputs: Any = None
        self.recording = True

    def __call__(self, *args: Any) -> Any:
        outputs = self.runnable(*args)
        if self.recording:
            self.inputs, self.outputs, self.recording = args, outputs, False
        return outputs

    def release(self) -> None:
        self.inputs = self.outputs = None
        self.recording = False


class PiecewiseCompileBackend:
    """The callable handed to ``torch.compile(backend=...)`` at level 3.

    After the call, ``cache_dir`` is this model's compile-cache directory, ``backend_seconds`` the
    time the call took (split, compile or load each piece), ``cache_key_factors`` what its hash
    covers (it and ``cache_dir`` None when the key could not be computed), and ``compile_cache``
    the open cache: None when disabled, when the directory can be neither written nor read, or for
    the eager compiler, which has nothing to save (``cache_off_reason`` says which). With
    ``record_first_call`` set, the returned runnable keeps its first call's inputs and outputs in
    ``first_call``, and ``input_sources``, ``piece_records`` and ``dynamic_input_indices`` say
    what a warm start needs to call the stored graph.
    """

    def __init__(
        self, config: EngineConfig, prefix: str = "", forward_code: CodeType | None = None
    ) -> None:
        self.config = config
        self.prefix = prefix
        self.forward_code = forward_code
        compilation = config.compilation_config
        assert compilation.backend is not None, "platform.check_and_update_config sets backend"
        self.compiler = make_compiler(compilation.backend, compilation.pass_config)
        self.split_gm: torch.fx.GraphModule | None = None
        self.cache_dir: str | None = None
        self.cache_key_factors: dict[str, Any] | None = None
        self.compile_cache: CompileCache | None = None
        self.cache_off_reason: str | None = None  # why compile_cache is None: "disabled (...)"
        self.graph_received_at: float | None = None  # perf_counter() when Dynamo's graph came
        self.backend_seconds = 0.0  # split, compile or load every piece, wrap
        self.graph_load_seconds = 0.0  # warm start: read and check the stored graph
        self.record_first_call = False
        self.first_call: FirstCallRecorder | None = None
        self.input_sources: list[str | None] = []  # each graph input's Dynamo source
        self.piece_records: list[dict[str, Any]] = []  # per capturable piece (piece_record)
        self.dynamic_input_indices: list[int] = []  # inputs with a symbolic first dim
        self.num_fusions: dict[str, int] = {}  # epilogue fusions made, by kind (traced starts)
        # The wrappers around the pieces (none without PIECEWISE graphs): the runner owns them.
        self.static_graph_wrappers: list[StaticGraphWrapperBase] = []

    def __call__(
        self, graph: torch.fx.GraphModule, example_inputs: Sequence[Any]
    ) -> Callable[..., Any]:
        compilation = self.config.compilation_config
        self.graph_received_at = time.perf_counter()  # Dynamo's trace ends here
        compilation_counter.num_graphs_seen += 1
        self.num_fusions = fuse_epilogues(graph, compilation.pass_config)
        self.compile_cache = self._open_cache(traced_source_files(self.forward_code))
        split_gm, items = split_graph(graph, compilation.splitting_ops or [])
        compile_names = [item.submod_name for item in items if not item.is_splitting_graph]
        compilation_counter.num_piecewise_graphs_seen += len(items)
        compilation_counter.num_piecewise_capturable_graphs_seen += len(compile_names)
        fake_mode = detect_fake_mode(example_inputs) or FakeTensorMode()
        manager = CompilerManager(self.compiler, self.compile_cache)
        self.static_graph_wrappers = []
        interpreter = PiecewiseCompileInterpreter(
            split_gm, compile_names, self.config, manager, fake_mode, self.static_graph_wrappers
        )
        interpreter.run(*example_inputs)
        self.split_gm = split_gm
        self.piece_records = interpreter.piece_records
        placeholders = graph.graph.find_nodes(op="placeholder")
        self.input_sources = [source_name(p) for p in placeholders]
        self.dynamic_input_indices = dynamic_input_indices(
            [p.meta.get("example_value") for p in placeholders]
        )
        self.backend_seconds = time.perf_counter() - self.graph_received_at
        self._dump(split_gm)
        runnable = self._runnable(split_gm)
        if self.record_first_call:
            self.first_call = FirstCallRecorder(runnable)
            return self.first_call
        return runnable

    def _runnable(self, split_gm: torch.fx.GraphModule) -> Callable[..., Any]:
        bound = bind_splitting_calls(split_gm)
        logger.debug("%d splitting submodules call their op directly", bound)
        if self.config.compilation_config.cudagraph_copy_inputs:
            return StaticInputCopier(split_gm, self.dynamic_input_indices)
        return split_gm

    def rebuild(self, record: dict[str, Any], traced_files: list[str]) -> Callable[..., Any]:
        """The stitched module of a stored graph, its pieces loaded from the compile cache the
        traced start wrote (``traced_files``: the files that trace read); raises
        ``TracedGraphDamaged`` when a piece's artifact is missing or does not load."""
        start = time.perf_counter()
        self.compile_cache = self._open_cache(traced_files)
        split_gm: torch.fx.GraphModule = record["split_graph"]
        pieces = record["pieces"]
        self._check_artifacts(pieces)
        manager = CompilerManager(self.compiler, self.compile_cache)
        loaded = []  # every artifact before any piece is built: a failure leaves nothing built
        for piece in pieces:
            index, keys = piece["index"], piece["artifact_keys"]
            graph = split_gm._modules[piece["submod_name"]]
            assert isinstance(graph, torch.fx.GraphModule)
            compiled = manager.load(graph, index, None, keys[None])
            if compiled is None:
                raise TracedGraphDamaged(f"the artifact of {entry_name(index, None)} does not load")
            loaded.append((piece, graph, compiled))
        self.static_graph_wrappers = []
        for piece, graph, compiled in loaded:
            index, keys = piece["index"], piece["artifact_keys"]
            backend = PiecewiseBackend(
                graph,
                self.config,
                index,
                len(pieces),
                piece["sym_shape_indices"],
                manager,
                compiled_general=compiled,
                artifact_keys=keys,
            )
            split_gm.__dict__[piece["submod_name"]] = wrap_piece(
                backend, index, len(pieces), self.config, self.static_graph_wrappers
            )
        self.split_gm = split_gm
        self.piece_records = pieces
        self.dynamic_input_indices = record["dynamic_input_indices"]
        self.backend_seconds = time.perf_counter() - start
        self._dump(split_gm)
        return self._runnable(split_gm)

    def _check_artifacts(self, pieces: list[dict[str, Any]]) -> None:
        """Raise ``TracedGraphDamaged`` before loading anything if an artifact is absent or fails
        its checksum (the trace that follows recompiles it, and warns)."""
        if not self.compiler.saves_artifacts:
            return  # the eager backend runs each piece's graph as is
        if self.compile_cache is None:
            raise TracedGraphDamaged(f"the compile cache is {self.cache_off_reason}")
        for piece in pieces:
            entry = entry_name(piece["index"], None)
            if not self.compile_cache.is_intact(entry, piece["artifact_keys"][None]):
                raise TracedGraphDamaged(
                    f"the artifact of {entry} in {self.cache_dir} is missing or fails its checksum"
                )

    def _open_cache(self, traced_files: list[str] | None) -> CompileCache | None:
        """Hash the key (the traced files are known now); open the directory if caching is on."""
        self.cache_off_reason = self._compute_key(traced_files)
        if self.cache_off_reason is None:
            assert self.cache_dir is not None and self.cache_key_factors is not None
            try:
                cache = CompileCache(self.cache_dir, self.cache_key_factors)
                logger.info("compile cache: %s", self.cache_dir)
                if not cache.entries:
                    reason = explain_miss(self.cache_dir, self.cache_key_factors)
                    logger.info("compile cache miss (compiling every piece): %s", reason)
                return cache
            except OSError as error:
                logger.warning(
                    "compile cache off: cannot write %s (%s); set PIECEWORKS_CACHE_ROOT or "
                    "CompilationConfig.cache_dir to a writable directory",
                    self.cache_dir,
                    error,
                )
                self.cache_off_reason = f"not used (cannot write {self.cache_dir})"
        logger.debug("compile cache %s", self.cache_off_reason)
        return None

    def _compute_key(self, traced_files: list[str] | None) -> str | None:
        """Fill ``cache_key_factors`` and ``cache_dir``; why the cache stays off, or None."""
        from pieceworks import envs

        if traced_files is None:
            return "not used (Dynamo did not report the files it traced)"
        self.cache_key_factors = cache_key_factors(self.config, self.compiler, traced_files)
        self.cache_dir = cache_directory(self.config, self.cache_key_factors, self.prefix)
        if not self.compiler.saves_artifacts:
            return f"not used (the {self.compiler.name} backend has nothing to save)"
        if envs.PIECEWORKS_DISABLE_COMPILE_CACHE:
            return "disabled (PIECEWORKS_DISABLE_COMPILE_CACHE=1)"
        return None

    def _dump(self, split_gm: torch.fx.GraphModule) -> None:
        path = dump_dir(self.config)
        if path is None:
            return
        with open(os.path.join(path, "computation_graph.py"), "w") as file:
            file.write(split_gm.print_readable(print_output=False))
        logger.info("split graph written to %s", path)


def dump_dir(config: EngineConfig) -> str | None:
    """``<debug_dump_path>/rank_<r>``, created; None when dumping is off."""
    from pieceworks import envs

    root = config.compilation_config.debug_dump_path or envs.PIECEWORKS_DEBUG_DUMP_PATH
    if not root:
        return None
    path = os.path.join(root, f"rank_{config.parallel_config.rank}")
    os.makedirs(path, exist_ok=True)
    return path
