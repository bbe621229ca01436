"""The static-graph contract every platform's wrapper follows, and ``StaticGraphSet``.

A static-graph wrapper is built as ``Wrapper(runnable, config, runtime_mode, *, options=None)`` and
called like ``runnable``. On each call it reads the forward context: if the step's runtime mode is
not its own it just calls through (this is how a FULL wrapper around the model and PIECEWISE
wrappers around the pieces nest); otherwise it captures once per ``BatchDescriptor`` and replays
after. ``StaticGraphWrapperBase`` implements that dispatch once; a platform's wrapper implements
only ``capture`` and ``replay``. Wrappers never copy inputs: the runner owns the static buffers.

A wrapper class that sets ``supports_breakable_capture`` also implements the segment primitives
(``begin_segment``, ``end_segment``, ``replay_segment``, optionally ``segment_capture``); built with
``CUDAGraphOptions(breakable=True)`` around the eager model, it captures and replays breakable
graphs (``core/breakable_graph.py``). Every capture runs with the capture marked in progress, so a
dynamic op that is not a splitting op is refused during a PIECEWISE capture.

Capture bookkeeping (whether capturing is open, how many captures the phase has run, which graphs
to drop at shutdown) lives in the ``StaticGraphSet`` its owner holds, not in process globals.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

from pieceworks.core.breakable_graph import (
    ActiveCapture,
    BreakableEntry,
    capture_breakable,
    capture_in_progress,
    replay_breakable,
)
from pieceworks.core.config import CUDAGraphMode
from pieceworks.core.forward_context import BatchDescriptor, get_forward_context
from pieceworks.logger import init_logger

if TYPE_CHECKING:
    from pieceworks.config import EngineConfig

logger = init_logger(__name__)


class StaticGraphSet:
    """The static-graph wrappers one owner built, and their capture phase.

    The model runner owns one: it adds the wrappers it builds around the model and those the
    compile backend built around the pieces, opens capturing before ``capture_model``, closes it
    after (a later capture raises), and at shutdown asks each of its wrappers to drop its graphs.
    The first capture after opening runs gc; later ones skip it (the runner collected just before,
    and repeating it for each of a hundred captures costs a full gc pass and a device sync each).
    A wrapper built alone starts in a set of its own, open, so it captures without an owner.
    """

    def __init__(self, wrappers: Iterable[StaticGraphWrapperBase] = ()) -> None:
        self.wrappers: list[StaticGraphWrapperBase] = []
        self.capturing_enabled = True
        self.num_captures_since_open = 0
        for wrapper in wrappers:
            self.add(wrapper)

    def add(self, wrapper: StaticGraphWrapperBase) -> None:
        """Own ``wrapper``: its captures count in, and are allowed by, this set's phase."""
        if all(owned is not wrapper for owned in self.wrappers):
            self.wrappers.append(wrapper)
        wrapper.graph_set = self

    def open_capturing(self) -> None:
        """Allow captures (the runner calls this before ``capture_model``)."""
        self.capturing_enabled = True
        self.num_captures_since_open = 0

    def close_capturing(self) -> None:
        """After the runner's capture phase: any further capture is a bug and raises."""
        self.capturing_enabled = False

    def record_capture(self) -> None:
        self.num_captures_since_open += 1

    def validate_capturing_enabled(self, descriptor: BatchDescriptor) -> None:
        if not self.capturing_enabled:
            raise RuntimeError(
                f"static-graph capture of {descriptor} attempted after capturing was "
                "closed: this batch shape was not captured in capture_model(); the "
                "runner must dispatch it to a captured size or to mode NONE"
            )

    def release(self) -> int:
        """Drop the captured graphs of every wrapper in the set; how many were dropped.

        An engine's shutdown calls this before its process group goes: NCCL destroys a
        communicator only once every graph holding one of its collectives is destroyed, and
        otherwise waits forever. Dynamo's cache keeps the piece wrappers alive beyond the runner,
        so this cannot wait for garbage collection. Capturing is closed afterwards.
        """
        self.close_capturing()
        return sum(wrapper.release_graphs() for wrapper in self.wrappers)


@dataclasses.dataclass
class CUDAGraphOptions:
    """Per-wrapper options (vLLM's names). Pieces set them by position in the model."""

    debug_log_enable: bool = True  # only the first piece logs each capture
    gc_disable: bool = False  # pieces after the first skip gc during capture (it is slow)
    weak_ref_output: bool = False  # only the last piece: nothing after it reads its output
    # The whole eager model (level 0): capture segments ended at each splitting op
    breakable: bool = False


@runtime_checkable
class StaticGraphWrapper(Protocol):
    """What the pipeline and the runner expect of a platform's static-graph wrapper class."""

    def __init__(
        self,
        runnable: Callable[..., Any],
        config: EngineConfig,
        runtime_mode: CUDAGraphMode,
        *,
        options: CUDAGraphOptions | None = None,
    ) -> None: ...

    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...


class StaticGraphWrapperBase:
    """Mode/descriptor dispatch shared by all wrappers; subclasses capture and replay."""

    # Whether the class implements the segment primitives below (breakable capture).
    supports_breakable_capture: ClassVar[bool] = False

    def __init__(
        self,
        runnable: Callable[..., Any],
        config: EngineConfig,
        runtime_mode: CUDAGraphMode,
        *,
        options: CUDAGraphOptions | None = None,
    ) -> None:
        if runtime_mode not in (CUDAGraphMode.FULL, CUDAGraphMode.PIECEWISE):
            raise ValueError(
                f"a static-graph wrapper captures FULL or PIECEWISE, not {runtime_mode.name}"
            )
        self.runnable = runnable
        self.config = config
        self.runtime_mode = runtime_mode
        self.options = options or CUDAGraphOptions()
        if self.options.breakable and not (
            self.supports_breakable_capture and runtime_mode == CUDAGraphMode.PIECEWISE
        ):
            raise ValueError(
                f"{type(self).__name__} cannot capture breakable {runtime_mode.name} graphs: "
                "breakable capture is PIECEWISE and needs a wrapper class with "
                "supports_breakable_capture (check Platform.supports_breakable_graphs())"
            )
        self.entries: dict[BatchDescriptor, Any] = {}
        self.graph_set = StaticGraphSet()
        self.graph_set.add(self)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        context = get_forward_context()
        descriptor = context.batch_descriptor
        if context.cudagraph_runtime_mode != self.runtime_mode or descriptor is None:
            return self.runnable(*args, **kwargs)
        entry = self.entries.get(descriptor)
        if entry is None:
            self.graph_set.validate_capturing_enabled(descriptor)
            from pieceworks.core.counters import compilation_counter

            if self.options.debug_log_enable:
                logger.debug("capturing %s graph for %s", self.runtime_mode.name, descriptor)
            if self.options.breakable:
                entry, output = capture_breakable(self, descriptor, args, kwargs)
            else:
                splitting_ops = frozenset(self.config.compilation_config.splitting_ops or [])
                with capture_in_progress(ActiveCapture(self.runtime_mode, splitting_ops)):
                    entry, output = self.capture(descriptor, args, kwargs)
                compilation_counter.num_cudagraph_captured += 1
            self.entries[descriptor] = entry
            self.graph_set.record_capture()
            return output
        if self.options.breakable:
            return replay_breakable(self, entry)
        return self.replay(entry, args, kwargs)

    def release_graphs(self) -> int:
        """Drop every graph captured so far; how many (a breakable entry holds one per segment,
        as ``num_cudagraph_captured`` counts them)."""
        released = sum(
            len(entry.segments) if isinstance(entry, BreakableEntry) else 1
            for entry in self.entries.values()
        )
        self.entries.clear()
        return released

    def capture(self, descriptor: BatchDescriptor, args: tuple, kwargs: dict) -> tuple[Any, Any]:
        """Capture one graph; return (entry kept for replay, the output of this call)."""
        raise NotImplementedError

    def replay(self, entry: Any, args: tuple, kwargs: dict) -> Any:
        raise NotImplementedError

    # --- segment primitives (breakable capture; supports_breakable_capture) ---------------------
    def segment_capture(self) -> contextlib.AbstractContextManager[Any]:
        """Entered once around a whole breakable capture (all of its segments)."""
        return contextlib.nullcontext()

    def begin_segment(self, descriptor: BatchDescriptor, *, first: bool) -> None:
        """Start recording device work into a new segment (``first``: the forward's first)."""
        raise NotImplementedError(f"{type(self).__name__} has no segment capture")

    def end_segment(self) -> Any:
        """Stop recording; the finished segment, handed back to ``replay_segment``."""
        raise NotImplementedError(f"{type(self).__name__} has no segment capture")

    def replay_segment(self, segment: Any) -> None:
        """Re-run one recorded segment on the addresses it was captured with."""
        raise NotImplementedError(f"{type(self).__name__} has no segment capture")

    def retained(self, value: Any) -> Any:
        """What a breakable entry keeps of the tensors it replays with: the capture's output and
        the recorded splitting ops' arguments (default: the tensors themselves)."""
        return value
