"""Breakable static graphs: one capture of the eager forward, ended at every splitting op.

With ``level=0`` (no Dynamo, no Inductor) the runner wraps the whole eager model in a PIECEWISE
static-graph wrapper built with ``CUDAGraphOptions(breakable=True)``. Its capture of a size runs
the forward once with segment recording on: when a splitting op (``splitting_ops``: attention,
``mamba_mixer2``) is reached, the wrapper's current segment ends, the op runs eagerly on its
arguments (segment outputs living in the graph's memory, its output buffer too), the (op, args)
pair is recorded, and the next segment begins. Replay alternates: segment 0, op 0 on its recorded
arguments, segment 1, ... The ops read the step's metadata from the forward context, so each
replay runs them with the real batch's plan, exactly like the level-3 split graph does.

This module also owns the capture-time guard of the *dynamic* ops (registered with
``direct_register_custom_op(..., dynamic=True)``, see ``core/custom_op.py``): their
implementation calls ``run_dynamic_op`` only while a capture is in progress (one module-global
test otherwise). During a PIECEWISE capture (a breakable segment, or a level-3 piece) a dynamic
op that is not a splitting op is refused with an error naming it: captured, its plan would be
frozen to the capture's batch and replayed wrong. A FULL capture records dynamic ops whole, as it
always has: the dispatcher hands it only the batch layout it was captured for.

The segment primitives (``begin_segment`` / ``end_segment`` / ``replay_segment``) are the
platform wrapper's; this module knows no device API.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

from pieceworks.core.config import CUDAGraphMode
from pieceworks.core.counters import compilation_counter

if TYPE_CHECKING:
    from pieceworks.config import EngineConfig
    from pieceworks.core.forward_context import BatchDescriptor


class DynamicOpCaptureError(RuntimeError):
    """A dynamic op reached during a piecewise capture without being a splitting op."""


@dataclasses.dataclass
class ActiveCapture:
    """The capture in progress: its mode, the splitting ops, and (breakable only) the break."""

    mode: CUDAGraphMode
    splitting_ops: frozenset[str]
    on_split: Callable[[str, Callable[..., Any], tuple, dict], Any] | None = None


# The capture in progress in this process, or None (the common case: the dynamic ops test this).
active_capture: ActiveCapture | None = None


@contextlib.contextmanager
def capture_in_progress(capture: ActiveCapture) -> Iterator[None]:
    """Mark ``capture`` as the one in progress for the block (captures never nest)."""
    global active_capture
    previous, active_capture = active_capture, capture
    try:
        yield
    finally:
        active_capture = previous


def run_dynamic_op(name: str, op_func: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """Run dynamic op ``name`` during a capture: through (FULL), as a break, or refused."""
    capture = active_capture
    if capture is None or capture.mode == CUDAGraphMode.FULL:
        return op_func(*args, **kwargs)
    if name in capture.splitting_ops and capture.on_split is not None:
        return capture.on_split(name, op_func, args, kwargs)
    raise DynamicOpCaptureError(
        f"dynamic op {name} was reached during a {capture.mode.name} static-graph capture but "
        f"is not a splitting op (splitting_ops: {sorted(capture.splitting_ops)}): captured, its "
        "plan would be frozen to the capture's batch and replayed wrong. Add it to "
        "CompilationConfig.splitting_ops, or use cudagraph_mode FULL / NONE."
    )


class SegmentRecorder(Protocol):
    """The segment primitives of a static-graph wrapper that supports breakable capture
    (``StaticGraphWrapperBase`` with ``supports_breakable_capture``): what this module drives."""

    runnable: Callable[..., Any]
    config: EngineConfig

    def segment_capture(self) -> contextlib.AbstractContextManager[Any]: ...

    def begin_segment(self, descriptor: BatchDescriptor, *, first: bool) -> None: ...

    def end_segment(self) -> Any: ...

    def replay_segment(self, segment: Any) -> None: ...

    def retained(self, value: Any) -> Any: ...


@dataclasses.dataclass
class EagerOpCall:
    """A splitting op as recorded at capture: replay calls it again on the same arguments."""

    name: str
    op_func: Callable[..., Any]
    args: tuple  # the capture's tensors: segment outputs and output buffers at static addresses
    kwargs: dict


@dataclasses.dataclass
class BreakableEntry:
    """One size's breakable capture: ``len(segments) == len(ops) + 1``."""

    batch_descriptor: BatchDescriptor
    segments: list[Any]
    ops: list[EagerOpCall]
    output: Any


def capture_breakable(
    wrapper: SegmentRecorder, descriptor: BatchDescriptor, args: tuple, kwargs: dict
) -> tuple[BreakableEntry, Any]:
    """Capture ``wrapper.runnable`` for ``descriptor`` as segments split at the splitting ops."""
    segments: list[Any] = []
    ops: list[EagerOpCall] = []
    recording = False  # a segment is open (false while a splitting op runs eagerly)

    def begin() -> None:
        nonlocal recording
        wrapper.begin_segment(descriptor, first=not segments)
        recording = True

    def end() -> None:
        nonlocal recording
        recording = False
        segments.append(wrapper.end_segment())

    def on_split(name: str, op_func: Callable[..., Any], op_args: tuple, op_kwargs: dict) -> Any:
        end()
        result = op_func(*op_args, **op_kwargs)
        ops.append(EagerOpCall(name, op_func, op_args, op_kwargs))
        begin()
        return result

    splitting_ops = frozenset(wrapper.config.compilation_config.splitting_ops or [])
    capture = ActiveCapture(CUDAGraphMode.PIECEWISE, splitting_ops, on_split)
    with wrapper.segment_capture(), capture_in_progress(capture):
        begin()
        try:
            output = wrapper.runnable(*args, **kwargs)
        finally:
            if recording:  # also on an error: never leave a device capture open
                end()
    compilation_counter.num_cudagraph_captured += len(segments)
    compilation_counter.num_breakable_segments_captured += len(segments)
    kept_ops = [
        EagerOpCall(op.name, op.op_func, wrapper.retained(op.args), wrapper.retained(op.kwargs))
        for op in ops
    ]
    return BreakableEntry(descriptor, segments, kept_ops, wrapper.retained(output)), output


def replay_breakable(wrapper: SegmentRecorder, entry: BreakableEntry) -> Any:
    """Segment 0, op 0 on its recorded arguments, segment 1, ..., the last segment."""
    for segment, op in zip(entry.segments, entry.ops, strict=False):
        wrapper.replay_segment(segment)
        op.op_func(*op.args, **op.kwargs)
    wrapper.replay_segment(entry.segments[-1])
    return entry.output
