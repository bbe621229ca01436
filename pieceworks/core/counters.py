"""``compilation_counter``: process-wide counts of what the compile pipeline did.

Tests pin exact behaviour with ``compilation_counter.expect(num_graphs_seen=1, ...)``: the block
must change each named counter by exactly that delta (unnamed counters may change freely). What
each counter counts: docs/compile_cache.md, "Counters"; the names and meanings are vLLM's.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Iterator


@dataclasses.dataclass
class CompilationCounter:
    num_models_seen: int = 0
    num_dynamo_traces: int = 0  # first calls that ran Dynamo (levels 2 and 3)
    num_traced_graphs_loaded: int = 0  # level-3 first calls that loaded the graph instead
    num_traced_graphs_saved: int = 0  # traced graphs stored for warm starts
    num_graphs_seen: int = 0
    num_piecewise_graphs_seen: int = 0  # submodules produced by split_graph
    num_piecewise_capturable_graphs_seen: int = 0  # ... of which are compiled and capturable
    num_backend_compilations: int = 0  # PiecewiseBackend instances built (one per capturable piece)
    num_inductor_compiles: int = 0
    num_eager_compiles: int = 0
    num_cudagraph_captured: int = 0  # device graphs: one per FULL capture, piece or segment
    num_breakable_segments_captured: int = 0  # segments of breakable captures (L + 1 per size)
    num_decode_tails_captured: int = 0  # the runner's decode tails (also device graphs above)
    num_gpu_runner_capture_triggers: int = 0  # capture runs of the model runner (capture_model)
    num_cache_entries_updated: int = 0
    num_compiled_artifacts_saved: int = 0
    num_compiled_artifacts_loaded: int = 0
    dynamo_as_is_count: int = 0

    def clone(self) -> CompilationCounter:
        return copy.deepcopy(self)

    @contextlib.contextmanager
    def expect(self, **deltas: int) -> Iterator[None]:
        """Assert that the block changes each named counter by exactly its delta."""
        unknown = set(deltas) - {field.name for field in dataclasses.fields(self)}
        if unknown:
            raise AttributeError(f"unknown counters: {sorted(unknown)}")
        before = self.clone()
        yield
        mismatches = [
            f"{name}: expected +{delta}, got +{getattr(self, name) - getattr(before, name)}"
            for name, delta in deltas.items()
            if getattr(self, name) - getattr(before, name) != delta
        ]
        if mismatches:
            raise AssertionError("compilation_counter mismatch: " + "; ".join(mismatches))


compilation_counter = CompilationCounter()
