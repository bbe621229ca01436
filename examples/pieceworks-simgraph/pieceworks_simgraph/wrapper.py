"""``SimGraphWrapper``: a static-graph wrapper that behaves like a device graph, on the CPU.

Capture runs the piece once and records the exact input and output tensors. Replay ignores the
tensors it is called with, re-runs the piece on the recorded inputs, and copies the result into the
recorded outputs. So, exactly as with a real CUDA graph, a caller that hands a fresh tensor instead
of copying new values into the captured input buffer gets a stale result. Dispatch by runtime mode
and batch descriptor comes from pieceworks' ``StaticGraphWrapperBase``.

Breakable capture (the eager model at level 0): each segment records every aten op it executes
(``segments.py``) and replays them on the recorded tensors, so segments obey the same contract.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any, ClassVar

import torch
from torch.utils._pytree import tree_map

from pieceworks.core.forward_context import BatchDescriptor
from pieceworks.core.static_graph import StaticGraphWrapperBase
from pieceworks.platforms import current_platform
from pieceworks_simgraph.segments import RecordedOp, SegmentRecorder, replay_ops


@dataclasses.dataclass
class SimGraph:
    args: tuple  # the recorded input tensors (the "static addresses")
    kwargs: dict
    output: Any  # the recorded output tensors, overwritten in place by each replay


def _copy_into(recorded: Any, fresh: Any) -> None:
    if isinstance(recorded, torch.Tensor):
        recorded.copy_(fresh)
    elif isinstance(recorded, (list, tuple)):
        for recorded_item, fresh_item in zip(recorded, fresh, strict=True):
            _copy_into(recorded_item, fresh_item)


class SimGraphWrapper(StaticGraphWrapperBase):
    """Simulated capture/replay with the static-address semantics of a device graph."""

    supports_breakable_capture: ClassVar[bool] = True
    _recorder: SegmentRecorder | None = None

    def capture(self, descriptor: BatchDescriptor, args: tuple, kwargs: dict) -> tuple[Any, Any]:
        output = self.runnable(*args, **kwargs)
        # The graph owns its output buffers, as a device graph's pool does.
        output = tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, output)
        current_platform().graph_pool().num_graphs += 1
        return SimGraph(args, kwargs, output), output

    def replay(self, entry: SimGraph, args: tuple, kwargs: dict) -> Any:
        _copy_into(entry.output, self.runnable(*entry.args, **entry.kwargs))
        return entry.output

    # --- segments of a breakable capture -------------------------------------------------------
    @contextlib.contextmanager
    def segment_capture(self) -> Iterator[None]:
        self._recorder = SegmentRecorder()
        try:
            with self._recorder:
                yield
        finally:
            self._recorder = None

    def begin_segment(self, descriptor: BatchDescriptor, *, first: bool) -> None:
        assert self._recorder is not None, "begin_segment() outside segment_capture()"
        self._recorder.ops = []

    def end_segment(self) -> list[RecordedOp]:
        assert self._recorder is not None and self._recorder.ops is not None
        ops, self._recorder.ops = self._recorder.ops, None
        current_platform().graph_pool().num_graphs += 1
        return ops

    def replay_segment(self, segment: list[RecordedOp]) -> None:
        replay_ops(segment)
