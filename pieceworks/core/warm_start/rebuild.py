"""A warm start that runs no Dynamo trace: store the traced split graph, rebuild the forward.

Traced start (level 3, cache on): after the first call, ``save_traced_graph`` stores the split
graph, each capturable piece's index, symbolic-size argument positions and artifact keys, and the
``GraphCall`` that replaces Dynamo's bytecode (``traced_graph_cache.py`` keys and writes it).
Later start with the same factors: ``load_traced_graph`` finds it, re-hashes the source files the
trace read, opens the compile cache the traced start used, loads every piece's artifact (the eager
backend runs each piece's graph as is), wraps the pieces as the traced start did and returns the
forward. Nothing is traced and nothing compiles. Anything that does not match falls back to the
trace, with the reason logged: a missing graph or changed factor (INFO, with the factors that
differ), an edited source file (INFO, naming it), a damaged graph file or a missing or damaged
piece artifact (WARNING; the trace then recompiles what is damaged and rewrites it).
"""

from __future__ import annotations

import dis
import time
from types import CodeType
from typing import TYPE_CHECKING, Any

import torch

from pieceworks.core.cache.cache_key import cache_key_factors
from pieceworks.core.counters import compilation_counter
from pieceworks.core.graph_call import (
    BoundGraphCall,
    GraphCall,
    UnsupportedGraphCall,
    bind_arguments,
    forward_arg_names,
)
from pieceworks.core.warm_start.traced_graph_store import (
    TracedGraphDamaged,
    TracedGraphStore,
    describe_arguments,
    portable_graph_module,
    resolve_traced_files,
    warm_start_factors,
)
from pieceworks.logger import init_logger

if TYPE_CHECKING:
    from pieceworks.core.backend import PiecewiseCompileBackend

logger = init_logger(__name__)

# Bytecode that changes Python state: Dynamo emits it to replay side effects of the forward,
# which a replay of the graph alone would drop.
_SIDE_EFFECT_OPS = {
    "STORE_ATTR",
    "STORE_GLOBAL",
    "STORE_SUBSCR",
    "STORE_DEREF",
    "DELETE_ATTR",
    "DELETE_GLOBAL",
    "DELETE_SUBSCR",
}


def traced_graph_store(
    backend: PiecewiseCompileBackend, module: torch.nn.Module, args: tuple, kwargs: dict
) -> TracedGraphStore | None:
    """The store of this module's traced graph for this first call; None when caching is off."""
    from pieceworks import envs

    if envs.PIECEWORKS_DISABLE_COMPILE_CACHE:
        return None
    arguments = bind_arguments(forward_arg_names(type(module).forward), args, kwargs)
    described = describe_arguments(arguments, getattr(module, "_pieceworks_dims", {}))
    factors = warm_start_factors(backend.config, backend.compiler, module, described)
    return TracedGraphStore(backend.config, factors, backend.prefix)


def side_effects(code: CodeType) -> list[str]:
    """The instructions of Dynamo's code that change Python state (``STORE_ATTR weight``)."""
    return [
        f"{instruction.opname} {instruction.argval}"
        for instruction in dis.get_instructions(code)
        if instruction.opname in _SIDE_EFFECT_OPS
    ]


def save_traced_graph(
    store: TracedGraphStore,
    backend: PiecewiseCompileBackend,
    module: torch.nn.Module,
    code: CodeType,
    call: tuple[tuple, dict[str, Any]],
    result: Any,
) -> GraphCall | None:
    """Store what the traced first call produced, so the next start can skip the trace; the
    ``GraphCall`` stored (None when the call cannot be replayed without Dynamo's bytecode)."""
    recorder = backend.first_call
    try:
        if backend.cache_key_factors is None or backend.split_gm is None or recorder is None:
            raise UnsupportedGraphCall(backend.cache_off_reason or "the cache key is unknown")
        effects = side_effects(code)
        if effects:
            raise UnsupportedGraphCall(f"the forward changes Python state ({effects[0]})")
        if recorder.inputs is None or recorder.outputs is None:
            raise UnsupportedGraphCall("the compiled graph did not run on the first call")
        graph_call = GraphCall.record(
            module, backend.input_sources, recorder.inputs, recorder.outputs, call, result
        )
        record = {
            "split_graph": portable_graph_module(backend.split_gm),
            "pieces": backend.piece_records,
            "dynamic_input_indices": backend.dynamic_input_indices,
            "call": graph_call.to_json(),
        }
        store.save(record, backend.cache_key_factors["traced_files"])
        compilation_counter.num_traced_graphs_saved += 1
        logger.info("traced graph stored for warm starts: %s", store.directory)
        return graph_call
    except UnsupportedGraphCall as reason:
        logger.info("traced graph not stored (%s): every start of this model traces", reason)
    except Exception as error:  # an unsaveable graph must not stop the model from running
        logger.warning("traced graph not stored in %s (%r)", store.directory, error)
    finally:
        if recorder is not None:
            recorder.release()
    return None


def load_traced_graph(
    store: TracedGraphStore, backend: PiecewiseCompileBackend, module: torch.nn.Module
) -> BoundGraphCall | None:
    """The forward rebuilt from the stored graph and cached artifacts; None (reason logged) when
    it cannot be, and the caller traces."""
    start = time.perf_counter()
    try:
        manifest = store.read_manifest()
        if isinstance(manifest, str):
            logger.info("warm start: no stored traced graph (%s); tracing", manifest)
            return None
        files = resolve_traced_files(list(manifest["traced_files"]))
        if isinstance(files, str):
            logger.info("warm start: %s; tracing", files)
            return None
        factors = cache_key_factors(backend.config, backend.compiler, files)
        changed = store.changed_files(manifest, factors["traced_files"])
        if changed:
            logger.info(
                "warm start: the stored graph was traced from other sources (%s); tracing",
                changed,
            )
            return None
        record = store.load_graph(manifest)
        graph_load_seconds = time.perf_counter() - start
        forward = backend.rebuild(record, files)
        bound = GraphCall.from_json(record["call"]).bind(module, forward)
    except UnsupportedGraphCall as reason:
        logger.info("warm start: the stored graph does not fit this module (%s); tracing", reason)
        return None
    except Exception as error:  # a damaged record surfaces as any error of its contents
        detail = str(error) if isinstance(error, TracedGraphDamaged) else repr(error)
        logger.warning(
            "warm start: the stored traced graph in %s is unusable (%s); tracing, and "
            "compiling what is damaged",
            store.directory,
            detail,
        )
        return None
    backend.graph_load_seconds = graph_load_seconds
    compilation_counter.num_traced_graphs_loaded += 1
    logger.info("warm start: traced graph loaded from %s (no Dynamo trace)", store.directory)
    return bound
