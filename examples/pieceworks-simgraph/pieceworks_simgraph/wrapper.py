"""``SimGraphWrapper``: a static-graph wrapper that behaves like a device graph, on the CPU.

Capture runs the piece once and records the exact input and output tensors. Replay ignores the
tensors it is called with, re-runs the piece on the recorded inputs, and copies the result into the
recorded outputs. So, exactly as with a real CUDA graph, a caller that hands a fresh tensor instead
of copying new values into the captured input buffer gets a stale result. Dispatch by runtime mode
and batch descriptor comes from pieceworks' ``StaticGraphWrapperBase``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch.utils._pytree import tree_map

from pieceworks.core.forward_context import BatchDescriptor
from pieceworks.core.static_graph import StaticGraphWrapperBase
from pieceworks.platforms import current_platform


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

    def capture(self, descriptor: BatchDescriptor, args: tuple, kwargs: dict) -> tuple[Any, Any]:
        output = self.runnable(*args, **kwargs)
        # The graph owns its output buffers, as a device graph's pool does.
        output = tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, output)
        current_platform().graph_pool().num_graphs += 1
        return SimGraph(args, kwargs, output), output

    def replay(self, entry: SimGraph, args: tuple, kwargs: dict) -> Any:
        _copy_into(entry.output, self.runnable(*entry.args, **entry.kwargs))
        return entry.output
