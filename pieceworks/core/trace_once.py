"""Trace once, then run the captured bytecode with no guard evaluation (levels 2 and 3).

The first call goes through ``torch.compile``; a bytecode hook records the code Dynamo produced for
the module's ``forward``. Every later call swaps that code into ``forward`` for the duration of the
call and runs it directly: Dynamo's frame evaluation and guards never run again, so nothing is
re-checked and nothing recompiles. That is safe because the runner keeps shapes inside the traced
dynamic dims and never changes which arguments are None. Level 1 is plain ``torch.compile``
(guards and recompiles allowed) and level 0 plain eager.

The trace is isolated from whatever else the process traced. Dynamo keeps per-code-object state
("automatic dynamic shapes"): when the same ``forward`` code is traced again with a different
value of some integer or size (a second model of another shape: ``q_size``, ``num_heads``,
``variance_epsilon``), it marks that value dynamic. Every instance of a model class shares its
``forward`` code, so the second and later models of a process would trace model constants as
symbols: different graphs from those a fresh process traces, and compile-cache artifacts that
do not match their entries. The trace therefore runs with automatic dynamic shapes off, so only
the dims declared by ``support_torch_compile`` are dynamic and every other value is a constant.

At level 3 with the compile cache on, the first call first looks for the split graph a previous
start traced (``warm_start.py``): found and valid, the forward runs as that graph's loaded pieces
through a ``BoundGraphCall`` (no Dynamo, no bytecode); otherwise it traces, and stores the graph.
Once that graph is stored, later calls of the traced start run through the same ``BoundGraphCall``
too (``traced_forward``): Dynamo's bytecode gathers every parameter of the model as a graph input
on every call, host time a PIECEWISE step pays, while the ``GraphCall`` binds them once. A start
that cannot store its call (the compile cache off, a forward with Python side effects) keeps the
bytecode.
"""

from __future__ import annotations

import contextlib
import dis
import os
import time
import weakref
from collections.abc import Callable, Iterator
from types import CodeType
from typing import TYPE_CHECKING, Any

import torch

from pieceworks.core.backend import PiecewiseCompileBackend, dump_dir
from pieceworks.core.config import CompilationLevel, CUDAGraphMode
from pieceworks.core.counters import compilation_counter
from pieceworks.core.warm_start.rebuild import (
    load_traced_graph,
    save_traced_graph,
    traced_graph_store,
)
from pieceworks.logger import init_logger

if TYPE_CHECKING:
    from pieceworks.config import EngineConfig
    from pieceworks.core.graph_call import BoundGraphCall

logger = init_logger(__name__)


def _decompile(code: CodeType) -> str:
    try:
        import depyf  # type: ignore[import-not-found]

        return depyf.decompile(code)
    except Exception:  # depyf is optional; bytecode is the fallback
        return dis.Bytecode(code).dis()


class WeakBackend:
    """What Dynamo is handed of a piecewise backend: a weak reference to it.

    Dynamo keeps every backend it is given for the life of the process
    (``torch._dynamo.eval_frame.cached_backends``), and a piecewise backend holds the compiled
    pieces and their graph wrappers, which with FULL graphs hold the model, its weights and its
    KV cache; handed the backend itself, Dynamo would keep all of that after the ``LLM`` is
    deleted. The ``TraceOnceCompiler`` that owns the backend keeps it alive while the model is."""

    def __init__(self, backend: PiecewiseCompileBackend) -> None:
        self._backend = weakref.ref(backend)

    def __call__(self, graph: torch.fx.GraphModule, example_inputs: Any) -> Callable[..., Any]:
        backend = self._backend()
        assert backend is not None, "a piecewise backend is called only while its model lives"
        return backend(graph, example_inputs)


class TraceOnceCompiler:
    """The compiled entry point of one ``support_torch_compile`` module instance."""

    def __init__(self, module: torch.nn.Module, config: EngineConfig, prefix: str) -> None:
        self.module = module
        self.config = config
        self.level = config.compilation_config.level
        self.original_code: CodeType = type(module).forward.__code__
        self.compiled_code: CodeType | None = None
        self.compiled_functions: dict[str, Any] = {}  # the globals compiled_code calls
        self._no_compiled_functions: dict[str, None] = {}  # the same names, bound to None
        self.piecewise_backend: PiecewiseCompileBackend | None = None  # level 3 only
        self.warm_forward: BoundGraphCall | None = None  # level 3: the stored graph, loaded
        # Level 3 after a trace whose call was stored: the same replay of the traced graph
        self.traced_forward: BoundGraphCall | None = None
        # Seconds of the first call, of its Dynamo trace, of reading the stored graph instead
        # (a warm start) and of the backend's compile or load (level 3; else 0).
        self.first_call_seconds = 0.0
        self.trace_seconds = 0.0
        self.graph_load_seconds = 0.0
        self.compile_seconds = 0.0
        self.compiled_callable = self._build_compiled_callable(prefix)

    def _build_compiled_callable(self, prefix: str) -> Callable[..., Any]:
        compilation = self.config.compilation_config
        backend: Any = compilation.backend
        if self.level == CompilationLevel.PIECEWISE:
            self.piecewise_backend = PiecewiseCompileBackend(
                self.config, prefix, self.original_code
            )
            backend = WeakBackend(self.piecewise_backend)
        options = compilation.inductor_compile_config or None if backend == "inductor" else None
        if self.level == CompilationLevel.DYNAMO_AS_IS:
            compilation_counter.dynamo_as_is_count += 1
            return torch.compile(self.module.forward, backend=backend, options=options)
        return torch.compile(self.module.forward, fullgraph=True, backend=backend, options=options)

    @property
    def uses_bytecode_dispatch(self) -> bool:
        return self.level >= CompilationLevel.DYNAMO_ONCE

    @property
    def is_ready(self) -> bool:
        """Whether the first call is over (traced, or its graph loaded)."""
        return self.compiled_code is not None or self.warm_forward is not None

    def compile_first_call(self, *args: Any, **kwargs: Any) -> Any:
        """Load the stored graph (level 3), else trace and compile, recording Dynamo's code."""
        backend = self.piecewise_backend
        store = traced_graph_store(backend, self.module, args, kwargs) if backend else None
        if store is not None:
            assert backend is not None
            start = time.perf_counter()
            self.warm_forward = load_traced_graph(store, backend, self.module)
            if self.warm_forward is not None:
                output = self.warm_forward(*args, **kwargs)
                self.first_call_seconds = time.perf_counter() - start
                self.graph_load_seconds = backend.graph_load_seconds
                self.compile_seconds = backend.backend_seconds
                return output
            backend.record_first_call = True
        if backend is not None:
            backend.compiler.start_workers()  # they come up while Dynamo traces
        output = self.trace_first_call(*args, **kwargs)
        if store is not None and self.compiled_code is not None:
            assert backend is not None
            recorder = backend.first_call  # save_traced_graph releases what it recorded
            graph_call = save_traced_graph(
                store, backend, self.module, self.compiled_code, (args, kwargs), output
            )
            if graph_call is not None and recorder is not None:
                self.traced_forward = graph_call.bind(self.module, recorder.runnable)
        return output

    def trace_first_call(self, *args: Any, **kwargs: Any) -> Any:
        """Trace and compile on the first call, recording the bytecode Dynamo produces."""
        recorded: list[CodeType] = []

        def hook(code: CodeType, new_code: CodeType) -> CodeType | None:
            if code is self.original_code:
                recorded.append(new_code)
            return None  # keep Dynamo's code unchanged

        if self.uses_bytecode_dispatch:
            # An entry a level-1 model of the same class left in Dynamo's cache could pass its
            # guards and run without a conversion, leaving no code to record: trace anew.
            torch._dynamo.eval_frame.remove_from_cache(self.original_code)
        handle = torch._dynamo.convert_frame.register_bytecode_hook(hook)
        compilation_counter.num_dynamo_traces += 1
        start = time.perf_counter()
        try:
            with torch._dynamo.config.patch(automatic_dynamic_shapes=False):
                output = self.compiled_callable(*args, **kwargs)
        finally:
            handle.remove()
        self._record_times(start, time.perf_counter())
        if self.uses_bytecode_dispatch:
            if not recorded:
                raise RuntimeError(
                    f"Dynamo produced no code for {type(self.module).__name__}."
                    "forward; is it already being compiled by an outer "
                    "torch.compile?"
                )
            self.compiled_code = recorded[-1]
            self._take_compiled_functions(self.compiled_code)
            # Later calls never consult Dynamo's cache; dropping this instance's entry keeps the
            # per-code cache from filling up (and pinning old models) as more instances compile.
            torch._dynamo.eval_frame.remove_from_cache(self.original_code)
            self._check_no_buffer_mutation(self.compiled_code)
            self._dump_transformed_code(self.compiled_code)
        return output

    def _record_times(self, start: float, end: float) -> None:
        """Split the first call into the Dynamo trace and the backend's split-and-compile (what
        is left of it ran the compiled model once)."""
        self.first_call_seconds = end - start
        backend = self.piecewise_backend
        if backend is not None and backend.graph_received_at is not None:
            self.trace_seconds = backend.graph_received_at - start
            self.compile_seconds = backend.backend_seconds

    def _check_no_buffer_mutation(self, code: CodeType) -> None:
        mode = self.config.compilation_config.cudagraph_mode
        if (
            self.level == CompilationLevel.PIECEWISE
            and mode != CUDAGraphMode.NONE
            and "update" in code.co_names
        ):
            raise RuntimeError(
                f"{type(self.module).__name__}.forward assigns module attributes or buffers "
                "during the forward pass; with static graphs the assignment would be frozen into "
                "the graph and silently go stale. Keep state in tensors updated in place, or "
                "set cudagraph_mode=NONE. Transformed code (look for `update`):\n"
                + _decompile(code)
            )

    def _dump_transformed_code(self, code: CodeType) -> None:
        path = dump_dir(self.config)
        if path is not None:
            with open(os.path.join(path, "transformed_code.py"), "w") as file:
                file.write(_decompile(code))

    def _take_compiled_functions(self, code: CodeType) -> None:
        """Move the functions Dynamo's code calls (``__compiled_fn_<n>``, the backend's result)
        from the globals of ``forward``'s module into this compiler, leaving None in their
        place. Left there they would outlive the model: the module holds them, they hold the
        compiled pieces and, with FULL graphs, the model, its weights and its KV cache, and
        Dynamo deletes such a global only once ``code`` is freed, which this compiler, owned by
        the model, keeps alive. ``dispatch_to_compiled_code`` puts them back for each call."""
        module_globals = type(self.module).forward.__globals__
        names = [name for name in code.co_names if name.startswith("__compiled_fn")]
        self.compiled_functions = {name: module_globals[name] for name in names}
        self._no_compiled_functions = dict.fromkeys(names)
        module_globals.update(self._no_compiled_functions)

    @contextlib.contextmanager
    def dispatch_to_compiled_code(self) -> Iterator[None]:
        """Run ``forward`` as the recorded compiled bytecode for the duration of the block."""
        forward = type(self.module).forward
        assert self.compiled_code is not None
        module_globals = forward.__globals__
        module_globals.update(self.compiled_functions)
        forward.__code__ = self.compiled_code
        try:
            yield
        finally:
            forward.__code__ = self.original_code
            module_globals.update(self._no_compiled_functions)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        forward = self.warm_forward or self.traced_forward
        if forward is not None:
            return forward(*args, **kwargs)
        if self.compiled_code is None and self.level != CompilationLevel.DYNAMO_AS_IS:
            return self.compile_first_call(*args, **kwargs)
        if not self.uses_bytecode_dispatch:
            return self.compiled_callable(*args, **kwargs)
        with self.dispatch_to_compiled_code():
            return self.module.forward(*args, **kwargs)


def trace_once_compilers(model: torch.nn.Module) -> list[TraceOnceCompiler]:
    """The ``TraceOnceCompiler`` of each ``support_torch_compile`` module in ``model``."""
    compilers = [getattr(module, "_pieceworks_compiler", None) for module in model.modules()]
    return [compiler for compiler in compilers if isinstance(compiler, TraceOnceCompiler)]
