"""``CUDAGraphWrapper``'s capture and replay on CPU, through a platform whose graph is a stub.

Proves, without a GPU: one capture per ``BatchDescriptor`` into the platform's one pool, replays
after (the stub graph counts them; the runnable does not run again and the captured output memory
comes back); a step whose mode is not the wrapper's, or that has no descriptor, calls through; a
capture after capturing was closed raises while captured sizes still replay; only a wrapper with
``weak_ref_output`` returns a weakly referenced output and only one with ``gc_disable`` skips gc;
in a piecewise toy model only the first piece runs gc and only the last returns weak outputs; with
debug logging, a replay on inputs at other addresses raises and only a wrapper with
``debug_log_enable`` logs its captures; a wrapper refuses a mode other than FULL or PIECEWISE and
a breakable FULL capture, saying why; a ``StaticGraphSet`` releases the graphs of its own
wrappers (a breakable capture's segments counted one by one) and no other's, and closes their
capturing; the first capture of a set's phase runs gc, later ones of any of its wrappers skip
it; the segment primitives of a breakable capture open one capture each into the pool, end it and
return its graph, replay it, and keep a segment's outputs as weak aliases. The same wrapper on
real CUDA graphs is tested by the GPU tests (``tests/core/test_piecewise.py`` on a GPU machine).
Run: pytest tests/core/test_cuda_graph.py
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Any, ClassVar

import pytest
import torch

from pieceworks import platforms
from pieceworks.config import EngineConfig, SchedulerConfig
from pieceworks.core.breakable_graph import BreakableEntry
from pieceworks.core.config import CompilationConfig, CompilationLevel, CUDAGraphMode
from pieceworks.core.counters import compilation_counter
from pieceworks.core.cuda_graph import CUDAGraphWrapper
from pieceworks.core.decorators import static_graph_wrappers
from pieceworks.core.forward_context import BatchDescriptor, set_forward_context
from pieceworks.core.static_graph import CUDAGraphOptions, StaticGraphSet
from pieceworks.platforms.cpu import CpuPlatform
from tests.core.toy_model import SILLY_OP, ToyModel

PIECEWISE = CUDAGraphMode.PIECEWISE


class StubGraph:
    """Stands in for ``torch.cuda.CUDAGraph``: counts its replays."""

    def __init__(self) -> None:
        self.num_replays = 0

    def replay(self) -> None:
        self.num_replays += 1


@dataclasses.dataclass
class Capture:
    graph: StubGraph
    pool: Any
    skip_gc: bool
    ended: bool = False  # the capture's context was left (the stream capture ended)


class StubGraphPlatform(CpuPlatform):
    """The CPU platform with ``CUDAGraphWrapper`` over stub graphs; records every capture."""

    name: ClassVar[str] = "stubgraph"
    static_graph_wrapper: ClassVar[str | None] = "pieceworks.core.cuda_graph.CUDAGraphWrapper"

    def __init__(self) -> None:
        super().__init__()
        self.captures: list[Capture] = []

    def _create_graph_pool(self) -> Any:
        return object()

    def create_graph(self) -> StubGraph:
        return StubGraph()

    @contextlib.contextmanager
    def graph_capture(self, graph: Any, pool: Any, *, skip_gc: bool = False):
        capture = Capture(graph, pool, skip_gc)
        self.captures.append(capture)
        try:
            yield
        finally:
            capture.ended = True


@pytest.fixture
def stub_platform(monkeypatch) -> StubGraphPlatform:
    platform = StubGraphPlatform()
    monkeypatch.setattr(platforms, "_current", platform)
    return platform


def piecewise_config(sizes: list[int]) -> EngineConfig:
    compilation = CompilationConfig(
        level=CompilationLevel.PIECEWISE,
        backend="eager",
        splitting_ops=[SILLY_OP],
        cudagraph_mode=PIECEWISE,
        cudagraph_capture_sizes=sizes,
    )
    return EngineConfig(
        scheduler_config=SchedulerConfig(max_num_seqs=max(sizes)), compilation_config=compilation
    )


def run(wrapper, config, mode, descriptor, *args):
    with set_forward_context(
        None, config, cudagraph_runtime_mode=mode, batch_descriptor=descriptor
    ):
        return wrapper(*args)


class Doubling:
    """A runnable that counts its calls and keeps each output it returns."""

    def __init__(self) -> None:
        self.outputs: list[torch.Tensor] = []

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.outputs.append(x * 2)
        return self.outputs[-1]


def is_weak_alias(tensor: torch.Tensor, of: torch.Tensor) -> bool:
    """``tensor`` views ``of``'s memory through a storage that does not own it."""
    return tensor.data_ptr() == of.data_ptr() and not tensor.untyped_storage().resizable()


def test_captures_once_per_descriptor_into_the_pool_then_replays(stub_platform):
    config, runnable = piecewise_config([2, 4]), Doubling()
    wrapper = CUDAGraphWrapper(runnable, config, PIECEWISE)
    x = torch.arange(4.0)
    with compilation_counter.expect(num_cudagraph_captured=2):
        captured = run(wrapper, config, PIECEWISE, BatchDescriptor(4), x)
        replayed = run(wrapper, config, PIECEWISE, BatchDescriptor(4), x)
        run(wrapper, config, PIECEWISE, BatchDescriptor(2), x[:2])
        run(wrapper, config, PIECEWISE, BatchDescriptor(4), x)
    assert len(runnable.outputs) == 2  # once per descriptor, at capture
    assert torch.equal(captured, x * 2)
    assert replayed.data_ptr() == captured.data_ptr()  # the captured output memory
    graphs = {desc.num_tokens: entry.graph for desc, entry in wrapper.entries.items()}
    assert (graphs[4].num_replays, graphs[2].num_replays) == (2, 0)
    assert [capture.graph for capture in stub_platform.captures] == [graphs[4], graphs[2]]
    # gc and empty_cache before the phase's first capture only: the second one skips them.
    assert [capture.skip_gc for capture in stub_platform.captures] == [False, True]
    assert {id(capture.pool) for capture in stub_platform.captures} == {
        id(stub_platform.graph_pool())
    }


@pytest.mark.parametrize(
    "mode, descriptor",
    [
        (CUDAGraphMode.FULL, BatchDescriptor(4)),
        (CUDAGraphMode.NONE, BatchDescriptor(4)),
        (PIECEWISE, None),
    ],
)
def test_another_mode_or_no_descriptor_calls_through(stub_platform, mode, descriptor):
    config, runnable = piecewise_config([4]), Doubling()
    wrapper = CUDAGraphWrapper(runnable, config, PIECEWISE)
    x = torch.arange(4.0)
    with compilation_counter.expect(num_cudagraph_captured=0):
        outputs = [run(wrapper, config, mode, descriptor, x) for _ in range(2)]
    assert [out is made for out, made in zip(outputs, runnable.outputs)] == [True, True]
    assert not wrapper.entries and not stub_platform.captures


def test_capture_after_close_raises_and_captured_sizes_still_replay(stub_platform):
    config, runnable = piecewise_config([2, 4]), Doubling()
    wrapper = CUDAGraphWrapper(runnable, config, PIECEWISE)
    x = torch.arange(4.0)
    run(wrapper, config, PIECEWISE, BatchDescriptor(4), x)
    wrapper.graph_set.close_capturing()
    with pytest.raises(RuntimeError) as error:
        run(wrapper, config, PIECEWISE, BatchDescriptor(2), x[:2])
    assert str(error.value) == (
        f"static-graph capture of {BatchDescriptor(2)} attempted after capturing was closed: "
        "this batch shape was not captured in capture_model(); the runner must dispatch it to "
        "a captured size or to mode NONE"
    )
    run(wrapper, config, PIECEWISE, BatchDescriptor(4), x)
    assert wrapper.entries[BatchDescriptor(4)].graph.num_replays == 1
    assert len(runnable.outputs) == 1 and len(stub_platform.captures) == 1


@pytest.mark.parametrize("weak_ref_output", [False, True])
@pytest.mark.parametrize("gc_disable", [False, True])
def test_weak_ref_and_gc_options(stub_platform, weak_ref_output, gc_disable):
    config, runnable = piecewise_config([4]), Doubling()
    options = CUDAGraphOptions(gc_disable=gc_disable, weak_ref_output=weak_ref_output)
    wrapper = CUDAGraphWrapper(runnable, config, PIECEWISE, options=options)
    output = run(wrapper, config, PIECEWISE, BatchDescriptor(4), torch.arange(4.0))
    (made,) = runnable.outputs
    if weak_ref_output:  # nothing after the last piece reads it: released into the pool
        assert output is not made and is_weak_alias(output, made)
    else:
        assert output is made
    assert is_weak_alias(wrapper.entries[BatchDescriptor(4)].output, made)  # kept for replay
    assert [capture.skip_gc for capture in stub_platform.captures] == [gc_disable]


def test_only_the_first_piece_runs_gc_and_only_the_last_returns_weak_outputs(stub_platform):
    num_layers = 2  # 3 capturable pieces
    config = piecewise_config([4])
    torch.manual_seed(0)
    model = ToyModel(config=config, num_layers=num_layers).requires_grad_(False)
    x = torch.randn(4, 8)
    run(model, config, CUDAGraphMode.NONE, None, x)  # trace, compile, warm up
    wrappers = static_graph_wrappers(model)
    assert [w.runnable.piece_index for w in wrappers] == [0, 1, 2]  # in piece order
    # Checked before capturing: a weak output read by a later piece would be read after free.
    assert [w.options.gc_disable for w in wrappers] == [False, True, True]
    assert [w.options.weak_ref_output for w in wrappers] == [False, False, True]
    assert [w.options.debug_log_enable for w in wrappers] == [True, False, False]
    output = run(model, config, PIECEWISE, BatchDescriptor(4), x)
    # Pieces capture in model order: only the first runs gc.
    assert [capture.skip_gc for capture in stub_platform.captures] == [False, True, True]
    assert not output.untyped_storage().resizable()  # the model's output is the last piece's


@pytest.fixture
def debug_logging():
    logger = logging.getLogger("pieceworks.core.cuda_graph")
    level = logger.level
    logger.setLevel(logging.DEBUG)  # setLevel, not the attribute: it clears the enabled cache
    yield
    logger.setLevel(level)


def test_debug_logging_checks_input_addresses_on_replay(stub_platform, debug_logging):
    config, runnable = piecewise_config([4]), Doubling()
    wrapper = CUDAGraphWrapper(runnable, config, PIECEWISE)
    static_x = torch.arange(4.0)
    run(wrapper, config, PIECEWISE, BatchDescriptor(4), static_x)
    run(wrapper, config, PIECEWISE, BatchDescriptor(4), static_x)  # same buffer: fine
    with pytest.raises(AssertionError) as error:
        run(wrapper, config, PIECEWISE, BatchDescriptor(4), static_x.clone())
    assert str(error.value) == (
        f"input addresses changed since the capture of {BatchDescriptor(4)}: static inputs must "
        "be copied into the runner's persistent buffers"
    )


def test_a_graph_set_releases_only_its_own_wrappers_graphs_and_counts_each(stub_platform):
    """Engine shutdown: every graph of the runner's wrappers goes (a breakable capture counts one
    graph per segment) and their capturing closes; a wrapper outside the set, even one built for
    the same config, keeps its graphs and still replays."""
    config = piecewise_config([2, 4])
    first, second, other = (CUDAGraphWrapper(Doubling(), config, PIECEWISE) for _ in range(3))
    graphs = StaticGraphSet([first, second])
    x = torch.arange(4.0)
    for size in (2, 4):
        run(first, config, PIECEWISE, BatchDescriptor(size), x[:size])
    run(second, config, PIECEWISE, BatchDescriptor(4), x)
    run(other, config, PIECEWISE, BatchDescriptor(4), x)
    descriptor = BatchDescriptor(8)
    second.entries[descriptor] = BreakableEntry(descriptor, [StubGraph()] * 3, [], None)
    assert graphs.release() == 2 + 1 + 3  # first: sizes 2 and 4; second: size 4 + 3 segments
    assert first.entries == {} and second.entries == {}
    assert graphs.release() == 0  # nothing left to drop
    with pytest.raises(RuntimeError, match="after capturing was closed"):
        run(first, config, PIECEWISE, BatchDescriptor(4), x)
    run(other, config, PIECEWISE, BatchDescriptor(4), x)
    assert other.entries[BatchDescriptor(4)].graph.num_replays == 1


def test_only_the_first_capture_of_a_sets_phase_runs_gc(stub_platform):
    """gc runs once per capture phase of the set, whichever of its wrappers captures first; a
    wrapper outside the set has its own phase; reopening starts a new phase."""
    config = piecewise_config([2, 4])
    first, second, alone = (CUDAGraphWrapper(Doubling(), config, PIECEWISE) for _ in range(3))
    graphs = StaticGraphSet([first, second])
    graphs.open_capturing()
    x = torch.arange(4.0)
    run(first, config, PIECEWISE, BatchDescriptor(4), x)
    run(second, config, PIECEWISE, BatchDescriptor(4), x)
    run(alone, config, PIECEWISE, BatchDescriptor(4), x)
    graphs.open_capturing()
    run(second, config, PIECEWISE, BatchDescriptor(2), x[:2])
    assert [capture.skip_gc for capture in stub_platform.captures] == [False, True, False, False]
    assert graphs.num_captures_since_open == 1 and alone.graph_set.num_captures_since_open == 1


@pytest.mark.parametrize("mode", [CUDAGraphMode.NONE, CUDAGraphMode.FULL_AND_PIECEWISE])
def test_a_wrapper_captures_only_full_or_piecewise(mode):
    with pytest.raises(ValueError, match=f"captures FULL or PIECEWISE, not {mode.name}$"):
        CUDAGraphWrapper(Doubling(), piecewise_config([4]), mode)


def test_breakable_capture_is_piecewise_only_and_says_where_to_check():
    options = CUDAGraphOptions(breakable=True)
    with pytest.raises(ValueError) as error:
        CUDAGraphWrapper(Doubling(), piecewise_config([4]), CUDAGraphMode.FULL, options=options)
    assert str(error.value) == (
        "CUDAGraphWrapper cannot capture breakable FULL graphs: breakable capture is PIECEWISE "
        "and needs a wrapper class with supports_breakable_capture (check "
        "Platform.supports_breakable_graphs())"
    )
    wrapper = CUDAGraphWrapper(Doubling(), piecewise_config([4]), PIECEWISE, options=options)
    assert wrapper.options.breakable


@pytest.mark.parametrize("debug_log_enable", [True, False])
def test_only_a_wrapper_with_debug_log_enable_logs_its_captures(
    stub_platform, debug_logging, caplog, monkeypatch, debug_log_enable
):
    monkeypatch.setattr(logging.getLogger("pieceworks"), "propagate", True)
    config = piecewise_config([4])
    options = CUDAGraphOptions(debug_log_enable=debug_log_enable)
    wrapper = CUDAGraphWrapper(Doubling(), config, PIECEWISE, options=options)
    with caplog.at_level(logging.DEBUG, logger="pieceworks.core.static_graph"):
        run(wrapper, config, PIECEWISE, BatchDescriptor(4), torch.arange(4.0))
    messages = {r.getMessage() for r in caplog.records if r.name == "pieceworks.core.static_graph"}
    expected = {f"capturing PIECEWISE graph for {BatchDescriptor(4)}"}
    assert messages == (expected if debug_log_enable else set())


def test_capture_passes_keyword_arguments_and_only_debug_logging_checks_addresses(stub_platform):
    """A FULL wrapper around a model is called with keyword arguments; without debug logging a
    replay costs no address check (keeping the inputs in place is the runner's contract)."""
    config = piecewise_config([4])

    def scaled(x: torch.Tensor, *, scale: float) -> torch.Tensor:
        return x * scale

    wrapper = CUDAGraphWrapper(scaled, config, PIECEWISE)
    with set_forward_context(
        None, config, cudagraph_runtime_mode=PIECEWISE, batch_descriptor=BatchDescriptor(4)
    ):
        captured = wrapper(torch.ones(4), scale=3.0)
        wrapper(torch.ones(4), scale=3.0)  # inputs elsewhere: replayed without a check
    assert captured.tolist() == [3.0] * 4
    assert wrapper.entries[BatchDescriptor(4)].input_addresses is None


def test_segments_are_captured_one_graph_each_into_the_pool_and_gc_runs_once(stub_platform):
    """The breakable-capture primitives on stub graphs: ``begin_segment`` opens a capture into
    the platform's pool (gc only for the first segment of a phase with no capture yet),
    ``end_segment`` ends it and returns its graph, ``replay_segment`` replays it."""
    config = piecewise_config([4])
    wrapper = CUDAGraphWrapper(Doubling(), config, PIECEWISE)
    descriptor = BatchDescriptor(4)
    wrapper.begin_segment(descriptor, first=True)
    assert [capture.ended for capture in stub_platform.captures] == [False]  # still capturing
    first = wrapper.end_segment()
    wrapper.begin_segment(descriptor, first=False)
    second = wrapper.end_segment()
    assert [capture.graph for capture in stub_platform.captures] == [first, second]
    assert isinstance(first, StubGraph) and first is not second
    assert [capture.skip_gc for capture in stub_platform.captures] == [False, True]
    assert [capture.ended for capture in stub_platform.captures] == [True, True]
    assert {id(capture.pool) for capture in stub_platform.captures} == {
        id(stub_platform.graph_pool())
    }
    wrapper.replay_segment(first)
    assert (first.num_replays, second.num_replays) == (1, 0)
    with pytest.raises(AssertionError, match=r"^end_segment\(\) without begin_segment\(\)$"):
        wrapper.end_segment()


def test_a_first_segment_after_another_capture_skips_gc(stub_platform):
    config = piecewise_config([4])
    wrapper = CUDAGraphWrapper(Doubling(), config, PIECEWISE)
    run(wrapper, config, PIECEWISE, BatchDescriptor(4), torch.arange(4.0))  # one capture
    wrapper.begin_segment(BatchDescriptor(2), first=True)
    wrapper.end_segment()
    assert [capture.skip_gc for capture in stub_platform.captures] == [False, True]


def test_retained_segment_values_are_weak_aliases(stub_platform):
    """A segment's outputs are kept as weak aliases of the pool's memory, in their container."""
    wrapper = CUDAGraphWrapper(Doubling(), piecewise_config([4]), PIECEWISE)
    hidden, residual = torch.arange(4.0), torch.ones(4)
    kept = wrapper.retained({"hidden": hidden, "residual": residual})
    assert list(kept) == ["hidden", "residual"]
    assert is_weak_alias(kept["hidden"], hidden) and is_weak_alias(kept["residual"], residual)
    pair = wrapper.retained((hidden, residual))
    assert type(pair) is tuple and all(map(is_weak_alias, pair, (hidden, residual)))
    assert is_weak_alias(wrapper.retained(hidden), hidden)
    assert torch.equal(kept["hidden"], hidden)


def test_a_call_through_keeps_keyword_arguments(stub_platform):
    config = piecewise_config([4])
    wrapper = CUDAGraphWrapper(lambda x, *, scale: x * scale, config, PIECEWISE)
    out = run_kwargs(wrapper, config, CUDAGraphMode.NONE, BatchDescriptor(4), torch.ones(4), 3.0)
    assert torch.equal(out, torch.full((4,), 3.0))


def run_kwargs(wrapper, config, mode, descriptor, x, scale):
    with set_forward_context(
        None, config, cudagraph_runtime_mode=mode, batch_descriptor=descriptor
    ):
        return wrapper(x, scale=scale)


def test_a_dynamic_op_reached_in_a_piecewise_capture_is_refused_naming_the_splitting_ops(
    stub_platform,
):
    from pieceworks.core.breakable_graph import DynamicOpCaptureError, run_dynamic_op

    config = piecewise_config([4])
    wrapper = CUDAGraphWrapper(
        lambda x: run_dynamic_op("pieceworks.plan_op", lambda t: t, (x,), {}), config, PIECEWISE
    )
    with pytest.raises(DynamicOpCaptureError) as error:
        run(wrapper, config, PIECEWISE, BatchDescriptor(4), torch.ones(4))
    assert f"(splitting_ops: {[SILLY_OP]})" in str(error.value)
