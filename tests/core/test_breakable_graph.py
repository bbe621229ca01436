"""Breakable static graphs on a toy model: segments at each splitting op, the op eager at replay.

Proves: a breakable capture of L splitting-op calls gives L + 1 segments (exact counters); replay
equals the eager forward, runs the splitting op eagerly each time with the step's own state, and
reads the captured input buffer, not its argument (stale inputs, stale results, as on a GPU); a
dynamic op that is not a splitting op is refused by name during a PIECEWISE capture and never
captured, while a FULL capture records it whole; a wrapper without segment capture cannot be built
breakable, and a platform whose wrapper has none turns level-0 piecewise graphs off with one log
line. Runs on the platform's graphs (CUDA: ``CUDAGraphWrapper``'s segments), or on the simgraph
example platform on CPU.
Run: pytest tests/core/test_breakable_graph.py
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn
from torch.library import Library

from pieceworks.config import EngineConfig, SchedulerConfig
from pieceworks.core.breakable_graph import DynamicOpCaptureError
from pieceworks.core.config import CompilationConfig, CompilationLevel, CUDAGraphMode
from pieceworks.core.counters import compilation_counter
from pieceworks.core.custom_op import direct_register_custom_op, is_dynamic_op
from pieceworks.core.decorators import support_torch_compile
from pieceworks.core.forward_context import BatchDescriptor, set_forward_context
from pieceworks.core.static_graph import CUDAGraphOptions, StaticGraphWrapperBase

pytestmark = pytest.mark.platform_agnostic

SPLIT_OP, UNMARKED_OP = "breakable_toy::scale", "breakable_toy::unmarked"
toy_lib = Library("breakable_toy", "FRAGMENT")
# The "step metadata" the dynamic ops read when they run (as attention reads the forward context).
step_state = {"scale": 1.0, "calls": 0}


def _scale(x: torch.Tensor, out: torch.Tensor) -> None:
    step_state["calls"] += 1
    out.copy_(x * step_state["scale"])


def _fake(x: torch.Tensor, out: torch.Tensor) -> None:
    return None


def toy_ops():
    """(split op, unmarked dynamic op): both dynamic; only the first is in splitting_ops."""
    split = direct_register_custom_op(
        "scale", _scale, ["out"], _fake, target_lib=toy_lib, dynamic=True
    )
    unmarked = direct_register_custom_op(
        "unmarked", _scale, ["out"], _fake, target_lib=toy_lib, dynamic=True
    )
    return split, unmarked


class ToyEagerModel(nn.Module):
    """``num_layers`` blocks of: linear, a dynamic op (split or unmarked), add the residual."""

    def __init__(self, num_layers: int, hidden_size: int = 8, op_name: str = SPLIT_OP) -> None:
        super().__init__()
        split, unmarked = toy_ops()
        self.op = split if op_name == SPLIT_OP else unmarked
        self.layers = nn.ModuleList(
            nn.Linear(hidden_size, hidden_size, bias=False) for _ in range(num_layers)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            h = layer(x)
            out = torch.empty_like(h)
            self.op(h, out)
            x = out + x
        return x * 2.0


def device() -> torch.device:
    from pieceworks.platforms import current_platform

    return current_platform().device()


def make_config(mode: CUDAGraphMode = CUDAGraphMode.PIECEWISE) -> EngineConfig:
    compilation = CompilationConfig(
        level=CompilationLevel.NO_COMPILATION,
        splitting_ops=[SPLIT_OP],
        cudagraph_mode=mode,
        cudagraph_capture_sizes=[4],
    )
    return EngineConfig(
        scheduler_config=SchedulerConfig(max_num_seqs=4), compilation_config=compilation
    )


def build(num_layers: int, op_name: str = SPLIT_OP) -> ToyEagerModel:
    torch.manual_seed(0)
    return ToyEagerModel(num_layers, op_name=op_name).to(device()).requires_grad_(False)


def breakable(model: nn.Module, config: EngineConfig) -> StaticGraphWrapperBase:
    from pieceworks.platforms import current_platform

    wrapper_cls = current_platform().static_graph_wrapper_cls()
    options = CUDAGraphOptions(breakable=True)
    return wrapper_cls(model, config, CUDAGraphMode.PIECEWISE, options=options)


def warm_up(model, config, x) -> None:
    """One call without graphs first, as the runner does (lazy device setup is not capturable)."""
    run(model, config, x, CUDAGraphMode.NONE)
    step_state["calls"] = 0


def run(model, config, x, mode=CUDAGraphMode.PIECEWISE, num_tokens=4) -> torch.Tensor:
    descriptor = BatchDescriptor(num_tokens) if mode != CUDAGraphMode.NONE else None
    with set_forward_context(
        None, config, cudagraph_runtime_mode=mode, batch_descriptor=descriptor
    ):
        return model(x)


@pytest.fixture(autouse=True)
def _reset_step_state():
    step_state.update(scale=1.0, calls=0)


def test_piecewise_modes_need_level_0_or_3():
    for mode in (CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL_AND_PIECEWISE):
        config = CompilationConfig(level=CompilationLevel.NO_COMPILATION, cudagraph_mode=mode)
        assert config.cudagraph_mode == mode
        with pytest.raises(ValueError, match="level 3 .* or level 0"):
            CompilationConfig(level=CompilationLevel.DYNAMO_ONCE, cudagraph_mode=mode)


def test_ops_are_marked_dynamic():
    toy_ops()
    assert is_dynamic_op(SPLIT_OP) and is_dynamic_op(UNMARKED_OP)


@torch.inference_mode()
def test_capture_gives_one_segment_more_than_splitting_op_calls(graph_platform):
    num_layers = 3
    config = make_config()
    model = build(num_layers)
    wrapper = breakable(model, config)
    static_input = torch.randn(4, 8, device=device())
    warm_up(model, config, static_input)
    # One capture of the forward; each of the L = 3 split-op calls ends a segment: L + 1 = 4.
    with compilation_counter.expect(num_cudagraph_captured=4, num_breakable_segments_captured=4):
        run(wrapper, config, static_input)
    entry = wrapper.entries[BatchDescriptor(4)]
    assert len(entry.segments) == num_layers + 1 and len(entry.ops) == num_layers
    assert [op.name for op in entry.ops] == [SPLIT_OP] * num_layers

    for scale in (0.5, 3.0):  # the op reads the step's own state at every replay
        step_state["scale"] = scale
        static_input.copy_(torch.randn(4, 8, device=device()))
        step_state["calls"] = 0
        with compilation_counter.expect(num_cudagraph_captured=0):
            replayed = run(wrapper, config, static_input).clone()
        assert step_state["calls"] == num_layers  # eager, once per layer, not captured
        expected = run(model, config, static_input, CUDAGraphMode.NONE)
        torch.testing.assert_close(replayed, expected)


@torch.inference_mode()
def test_replay_reads_the_captured_buffer_not_the_argument(graph_platform):
    config = make_config()
    model = build(2)
    wrapper = breakable(model, config)
    static_input = torch.randn(4, 8, device=device())
    warm_up(model, config, static_input)
    run(wrapper, config, static_input)
    captured_input = static_input.clone()
    fresh = torch.randn(4, 8, device=device())  # a new tensor at a new address: ignored
    stale = run(wrapper, config, fresh).clone()
    torch.testing.assert_close(stale, run(model, config, captured_input, CUDAGraphMode.NONE))
    assert not torch.allclose(stale, run(model, config, fresh, CUDAGraphMode.NONE))


@torch.inference_mode()
def test_unmarked_dynamic_op_is_refused_by_name(graph_platform):
    config = make_config()
    model = build(2, op_name=UNMARKED_OP)
    wrapper = breakable(model, config)
    x = torch.randn(4, 8, device=device())
    warm_up(model, config, x)
    with compilation_counter.expect(num_cudagraph_captured=0, num_breakable_segments_captured=0):
        with pytest.raises(DynamicOpCaptureError, match="breakable_toy::unmarked.*not a splitting"):
            run(wrapper, config, x)
    assert wrapper.entries == {}  # never captured
    step_state["calls"] = 0
    run(model, config, x, CUDAGraphMode.NONE)  # outside a capture the op runs as always
    assert step_state["calls"] == 2


@torch.inference_mode()
def test_full_capture_records_dynamic_ops_whole(graph_platform):
    config = make_config(CUDAGraphMode.FULL)
    model = build(2, op_name=UNMARKED_OP)
    wrapper_cls = graph_platform.static_graph_wrapper_cls()
    wrapper = wrapper_cls(model, config, CUDAGraphMode.FULL)
    x = torch.randn(4, 8, device=device())
    warm_up(model, config, x)
    with compilation_counter.expect(num_cudagraph_captured=1, num_breakable_segments_captured=0):
        run(wrapper, config, x, CUDAGraphMode.FULL)
    torch.testing.assert_close(
        run(wrapper, config, x, CUDAGraphMode.FULL).clone(),
        run(model, config, x, CUDAGraphMode.NONE),
    )


class NoSegmentsWrapper(StaticGraphWrapperBase):
    """A wrapper that captures whole graphs only (no segment primitives)."""

    def capture(self, descriptor, args, kwargs):
        return None, self.runnable(*args, **kwargs)

    def replay(self, entry, args, kwargs):
        return self.runnable(*args, **kwargs)


def test_wrapper_without_segments_cannot_be_built_breakable():
    config = make_config()
    options = CUDAGraphOptions(breakable=True)
    with pytest.raises(ValueError, match="NoSegmentsWrapper cannot capture breakable"):
        NoSegmentsWrapper(nn.Identity(), config, CUDAGraphMode.PIECEWISE, options=options)


def test_a_wrapper_without_segments_says_so_for_each_primitive():
    wrapper = NoSegmentsWrapper(nn.Identity(), make_config(), CUDAGraphMode.PIECEWISE)
    primitives = [
        lambda: wrapper.begin_segment(BatchDescriptor(1), first=True),
        wrapper.end_segment,
        lambda: wrapper.replay_segment(None),
    ]
    for primitive in primitives:
        with pytest.raises(NotImplementedError, match="^NoSegmentsWrapper has no segment capture$"):
            primitive()


@support_torch_compile
class ToyCompiledModel(nn.Module):
    """A split op, then an unmarked dynamic op that the split leaves inside a piece."""

    def __init__(self, *, config: EngineConfig, prefix: str = "") -> None:
        super().__init__()
        self.split, self.unmarked = toy_ops()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x)
        self.split(x, out)
        unmarked_out = torch.empty_like(out)
        self.unmarked(out + 1.0, unmarked_out)
        return unmarked_out * 2.0


@torch.inference_mode()
def test_level_3_piece_capture_refuses_an_unmarked_dynamic_op(graph_platform):
    compilation = CompilationConfig(
        level=CompilationLevel.PIECEWISE,
        backend="eager",
        splitting_ops=[SPLIT_OP],
        cudagraph_mode=CUDAGraphMode.PIECEWISE,
        cudagraph_capture_sizes=[4],
    )
    config = EngineConfig(
        scheduler_config=SchedulerConfig(max_num_seqs=4), compilation_config=compilation
    )
    model = ToyCompiledModel(config=config).to(device())
    x = torch.randn(4, 8, device=device())
    run(model, config, x, CUDAGraphMode.NONE)  # trace and compile: no capture, no guard
    with pytest.raises(DynamicOpCaptureError, match="breakable_toy::unmarked"):
        run(model, config, x)  # the second piece holds the unmarked op: refused at capture


def test_platform_without_segment_capture_turns_level_0_piecewise_off(caplog, monkeypatch):
    simgraph = pytest.importorskip("pieceworks_simgraph.platform")
    from pieceworks import platforms

    class NoSegmentsPlatform(simgraph.SimGraphPlatform):
        name = "no-segments"
        static_graph_wrapper = f"{__name__}.NoSegmentsWrapper"

    monkeypatch.setattr(platforms, "_current", NoSegmentsPlatform())
    logging.getLogger("pieceworks").propagate = True
    try:
        with caplog.at_level(logging.INFO, logger="pieceworks"):
            config = make_config(CUDAGraphMode.FULL_AND_PIECEWISE)
    finally:
        logging.getLogger("pieceworks").propagate = False
    assert config.compilation_config.cudagraph_mode == CUDAGraphMode.NONE
    assert "cannot capture breakable graphs" in caplog.text
    # Level 3 pieces and level-0 FULL graphs need no segments: they stay on.
    monkeypatch.setattr(platforms, "_current", NoSegmentsPlatform())
    assert make_config(CUDAGraphMode.FULL).compilation_config.cudagraph_mode == CUDAGraphMode.FULL
