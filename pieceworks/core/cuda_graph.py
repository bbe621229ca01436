"""``CUDAGraphWrapper``: the default static-graph wrapper (CUDA Graphs; HIP Graphs on ROCm).

It captures through the platform's graph primitives (``create_graph``, ``graph_capture``) into the
platform's one shared pool, so this module names no device API. Dispatch by mode and descriptor is
``StaticGraphWrapperBase``'s; this class only captures and replays. Inputs are never copied: the
runner keeps them at fixed addresses, and with debug logging on, replay checks that they are.

Breakable capture (``core/breakable_graph.py``): each segment is one device graph captured through
the same primitives into the same pool; between segments the splitting op runs eagerly on the
current stream, and replay launches segment graphs and the ops on that stream in order.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Any, ClassVar

import torch

from pieceworks.core.forward_context import BatchDescriptor
from pieceworks.core.static_graph import StaticGraphWrapperBase
from pieceworks.core.weak_ref import weak_ref_tensors
from pieceworks.logger import init_logger
from pieceworks.platforms import current_platform

logger = init_logger(__name__)


@dataclasses.dataclass
class CUDAGraphEntry:
    batch_descriptor: BatchDescriptor
    graph: Any
    output: Any  # weakly referenced: the pool owns the memory
    input_addresses: list[int] | None = None  # recorded only with debug logging


def _tensor_addresses(args: tuple) -> list[int]:
    return [arg.data_ptr() for arg in args if isinstance(arg, torch.Tensor)]


class CUDAGraphWrapper(StaticGraphWrapperBase):
    """Captures one device graph per BatchDescriptor into the platform's shared pool."""

    supports_breakable_capture: ClassVar[bool] = True
    _segment: tuple[Any, contextlib.ExitStack] | None = None  # (graph, its open capture)

    def capture(self, descriptor: BatchDescriptor, args: tuple, kwargs: dict) -> tuple[Any, Any]:
        platform = current_platform()
        graph = platform.create_graph()
        skip_gc = self.options.gc_disable or self.graph_set.num_captures_since_open > 0
        with platform.graph_capture(graph, platform.graph_pool(), skip_gc=skip_gc):
            output = self.runnable(*args, **kwargs)
            if self.options.weak_ref_output:
                # Release the last piece's output into the pool at once: nothing after it in this
                # step reads it inside a graph, and the next (smaller) capture can reuse it.
                output = weak_ref_tensors(output)
        addresses = _tensor_addresses(args) if logger.isEnabledFor(logging.DEBUG) else None
        entry = CUDAGraphEntry(descriptor, graph, weak_ref_tensors(output), addresses)
        return entry, output

    def replay(self, entry: CUDAGraphEntry, args: tuple, kwargs: dict) -> Any:
        if entry.input_addresses is not None:
            addresses = _tensor_addresses(args)
            if addresses != entry.input_addresses:
                raise AssertionError(
                    f"input addresses changed since the capture of "
                    f"{entry.batch_descriptor}: static inputs must be copied "
                    "into the runner's persistent buffers"
                )
        entry.graph.replay()
        return entry.output

    # --- segments of a breakable capture -------------------------------------------------------
    def begin_segment(self, descriptor: BatchDescriptor, *, first: bool) -> None:
        platform = current_platform()
        graph = platform.create_graph()
        stack = contextlib.ExitStack()
        # gc and empty_cache once per capture phase (its first segment); later ones only cost time.
        skip_gc = not first or self.graph_set.num_captures_since_open > 0
        stack.enter_context(platform.graph_capture(graph, platform.graph_pool(), skip_gc=skip_gc))
        self._segment = (graph, stack)

    def end_segment(self) -> Any:
        assert self._segment is not None, "end_segment() without begin_segment()"
        graph, stack = self._segment
        self._segment = None
        stack.close()  # ends the stream capture
        return graph

    def replay_segment(self, segment: Any) -> None:
        segment.replay()

    def retained(self, value: Any) -> Any:
        # As for FULL graphs and pieces: the pool owns the memory, and another size's capture may
        # reuse it, which is safe because graphs of different sizes never replay interleaved.
        if isinstance(value, dict):
            return {name: weak_ref_tensors(item) for name, item in value.items()}
        return weak_ref_tensors(value)
