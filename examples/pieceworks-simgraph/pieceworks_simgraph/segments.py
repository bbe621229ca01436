"""Simulated graph segments: every aten op of a segment recorded, replayed on the same tensors.

A breakable capture (``pieceworks.core.breakable_graph``) runs the eager forward once and ends a
segment at each splitting op. While a segment records, ``SegmentRecorder`` (a ``TorchDispatchMode``
entered once around the whole capture) keeps each op executed with its exact argument and output
tensors. Replay re-executes the recorded ops in order on the recorded tensors and copies each
fresh result into the recorded output, so every later op reads it there: the static-address
semantics of a device graph, op by op. Stale inputs give stale results, as on a GPU.

An op that is running while a segment ends (the splitting op itself, which breaks the capture from
inside its implementation) is not recorded: it belongs to no segment and runs eagerly at replay.
Allocation-only ops (``empty``) are kept for their outputs but not re-run: on a device they launch
no work, so a replayed buffer keeps the values last written into it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

aten = torch.ops.aten
# Ops that only allocate: a device graph replays nothing for them.
_ALLOCATION_OPS = {
    aten.empty.memory_format,
    aten.empty_like.default,
    aten.empty_strided.default,
    aten.new_empty.default,
    aten.new_empty_strided.default,
}
# Ops that read a device value into host memory: illegal while a device graph captures.
_HOST_SYNC_OPS = {aten._local_scalar_dense.default, aten.item.default}


@dataclasses.dataclass
class RecordedOp:
    func: Any
    args: tuple
    kwargs: dict
    output: Any


class SegmentRecorder(TorchDispatchMode):
    """Appends each op executed to ``ops`` while it is a list (None: a segment is not open)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[RecordedOp] | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        ops = self.ops
        if ops is not None and func in _HOST_SYNC_OPS:
            raise RuntimeError(
                f"{func} reads a device value on the host during a static-graph capture; "
                "a device graph cannot capture it (keep the forward free of .item() / .tolist())"
            )
        output = func(*args, **kwargs)
        if ops is not None and ops is self.ops:  # the segment did not end during the call
            ops.append(RecordedOp(func, args, kwargs, output))
        return output


def replay_ops(ops: list[RecordedOp]) -> None:
    """Re-execute ``ops`` in order; each fresh result lands in the recorded output tensors."""
    for op in ops:
        if op.func in _ALLOCATION_OPS:
            continue
        fresh = op.func(*op.args, **op.kwargs)
        for recorded, value in zip(tree_leaves(op.output), tree_leaves(fresh), strict=True):
            # Same address: an in-place op or a view of a recorded tensor, already up to date.
            if isinstance(recorded, torch.Tensor) and recorded.data_ptr() != value.data_ptr():
                recorded.copy_(value)
