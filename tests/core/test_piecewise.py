"""The piecewise pipeline on a toy model: exact counters, replay equals compiled, split op runs.

Every number in ``compilation_counter.expect`` is derived from SPEC §3 for L layers (L split ops)
and capture sizes S: graphs 1, pieces 2L+1, capturable L+1, backend compilations L+1,
captures |S|·(L+1) for PIECEWISE, plus |S| for FULL, each phase counted on its own; a static
``compile_sizes`` entry gets one compile a piece, logged, the first time its size runs; a piece
with neither example inputs nor a loaded artifact is refused. Runs on the platform's graphs, or
on the simgraph example platform on CPU.
Run: pytest tests/core/test_piecewise.py
"""

from __future__ import annotations

import logging

import pytest
import torch

from pieceworks.config import EngineConfig, SchedulerConfig
from pieceworks.core.compiler_interface import EagerAdaptor
from pieceworks.core.compiler_manager import CompilerManager
from pieceworks.core.config import CompilationConfig, CompilationLevel, CUDAGraphMode
from pieceworks.core.counters import compilation_counter
from pieceworks.core.decorators import static_graph_wrappers
from pieceworks.core.forward_context import BatchDescriptor, set_forward_context
from pieceworks.core.piecewise_backend import PiecewiseBackend
from pieceworks.core.static_graph import StaticGraphSet
from tests.core.toy_model import SILLY_OP, ToyModel, silly_calls

pytestmark = pytest.mark.platform_agnostic


def make_config(
    mode: CUDAGraphMode,
    sizes: list[int],
    backend: str = "eager",
    level: CompilationLevel = CompilationLevel.PIECEWISE,
) -> EngineConfig:
    compilation = CompilationConfig(
        level=level,
        backend=backend,
        splitting_ops=[SILLY_OP],
        cudagraph_mode=mode,
        cudagraph_capture_sizes=sizes,
    )
    return EngineConfig(
        scheduler_config=SchedulerConfig(max_num_seqs=max(sizes)), compilation_config=compilation
    )


def device() -> torch.device:
    from pieceworks.platforms import current_platform

    return current_platform().device()


def build(config: EngineConfig, num_layers: int, **kwargs) -> ToyModel:
    torch.manual_seed(0)
    model = ToyModel(config=config, num_layers=num_layers, **kwargs).to(device())
    return model.requires_grad_(False)  # inference, as the engine runs models


def run(model, config, x, mode=CUDAGraphMode.NONE, descriptor=None) -> torch.Tensor:
    with set_forward_context(
        None, config, cudagraph_runtime_mode=mode, batch_descriptor=descriptor
    ):
        return model(x)


def capture_all(runnable, config, static_x, sizes, mode) -> None:
    """The runner's capture loop in miniature: largest size first, one warm-up each."""
    for size in sorted(sizes, reverse=True):
        run(runnable, config, static_x[:size])  # warm-up, mode NONE
        run(runnable, config, static_x[:size], mode, BatchDescriptor(size))


@pytest.mark.parametrize("num_layers,sizes", [(1, [1, 2]), (2, [1, 2, 4]), (3, [4, 8])])
def test_piecewise_counters_and_outputs(graph_platform, num_layers, sizes):
    config = make_config(CUDAGraphMode.PIECEWISE, sizes)
    model = build(config, num_layers)
    max_size = max(sizes)
    static_x = torch.randn(max_size, 8, device=device())
    eager_model = build(
        make_config(CUDAGraphMode.NONE, sizes, level=CompilationLevel.NO_COMPILATION), num_layers
    )

    with compilation_counter.expect(
        num_graphs_seen=1,
        num_piecewise_graphs_seen=2 * num_layers + 1,
        num_piecewise_capturable_graphs_seen=num_layers + 1,
        num_backend_compilations=num_layers + 1,
        num_cudagraph_captured=len(sizes) * (num_layers + 1),
    ):
        capture_all(model, config, static_x, sizes, CUDAGraphMode.PIECEWISE)

    for size in sizes:
        static_x[:size].copy_(torch.randn(size, 8))
        compiled = run(model, config, static_x[:size]).clone()
        calls_before = silly_calls["count"]
        with compilation_counter.expect(num_cudagraph_captured=0, num_graphs_seen=0):
            replayed = run(
                model, config, static_x[:size], CUDAGraphMode.PIECEWISE, BatchDescriptor(size)
            ).clone()
        assert silly_calls["count"] == calls_before + num_layers  # split op ran outside graphs
        assert torch.equal(replayed, compiled)  # bitwise: same compiled code, graph or not
        torch.testing.assert_close(replayed, eager_model(static_x[:size]))


@pytest.mark.parametrize("mode", [CUDAGraphMode.FULL, CUDAGraphMode.FULL_AND_PIECEWISE])
def test_full_graph_counters(graph_platform, mode):
    num_layers, sizes = 2, [1, 2, 4]
    config = make_config(mode, sizes)
    model = build(config, num_layers)
    full = graph_platform.static_graph_wrapper_cls()(model, config, CUDAGraphMode.FULL)
    static_x = torch.randn(4, 8, device=device())
    pieces_per_size = (num_layers + 1) if mode.has_piecewise_cudagraphs() else 0
    # Each phase captures only its own wrappers: the PIECEWISE phase one graph per piece and size
    # (the FULL wrapper calls through), the FULL phase one graph per size (the pieces call through
    # while the FULL graph records them). A total over both phases would also accept wrappers that
    # capture in the other's mode.
    with compilation_counter.expect(num_cudagraph_captured=len(sizes) * pieces_per_size):
        if mode.has_piecewise_cudagraphs():
            capture_all(full, config, static_x, sizes, CUDAGraphMode.PIECEWISE)
    assert len(full.entries) == 0
    with compilation_counter.expect(num_cudagraph_captured=len(sizes)):
        capture_all(full, config, static_x, sizes, CUDAGraphMode.FULL)
    assert sorted(descriptor.num_tokens for descriptor in full.entries) == sorted(sizes)
    for size in sizes:
        static_x[:size].copy_(torch.randn(size, 8))
        compiled = run(full, config, static_x[:size]).clone()
        calls_before = silly_calls["count"]
        replayed = run(full, config, static_x[:size], CUDAGraphMode.FULL, BatchDescriptor(size))
        assert torch.equal(replayed, compiled)
        if not graph_platform.name == "simgraph":
            assert silly_calls["count"] == calls_before  # a real FULL graph never runs Python


def test_none_mode_captures_nothing(graph_platform):
    config = make_config(CUDAGraphMode.NONE, [1, 2])
    model = build(config, 2)
    x = torch.randn(2, 8, device=device())
    with compilation_counter.expect(
        num_graphs_seen=1, num_piecewise_graphs_seen=5, num_cudagraph_captured=0
    ):
        run(model, config, x)
        run(model, config, x[:1], CUDAGraphMode.PIECEWISE, BatchDescriptor(1))


def test_identity_weights_match_closed_form(graph_platform):
    # Per layer: x -> x (identity linear) -> out = 3x -> 0.5 * 3x + x = 2.5x; then final * 2.
    config = make_config(CUDAGraphMode.PIECEWISE, [2])
    model = build(config, 2, identity=True)
    static_x = torch.randn(2, 8, device=device())
    capture_all(model, config, static_x, [2], CUDAGraphMode.PIECEWISE)
    static_x.copy_(torch.randn(2, 8))
    out = run(model, config, static_x, CUDAGraphMode.PIECEWISE, BatchDescriptor(2))
    torch.testing.assert_close(out, static_x * 2.5 * 2.5 * 2.0)


def test_second_model_with_other_shapes_in_same_process(graph_platform):
    config_a = make_config(CUDAGraphMode.PIECEWISE, [2])
    config_b = make_config(CUDAGraphMode.PIECEWISE, [4])
    model_a = build(config_a, 1, hidden_size=8)
    model_b = build(config_b, 3, hidden_size=16)
    x_a = torch.randn(2, 8, device=device())
    x_b = torch.randn(4, 16, device=device())
    capture_all(model_a, config_a, x_a, [2], CUDAGraphMode.PIECEWISE)
    capture_all(model_b, config_b, x_b, [4], CUDAGraphMode.PIECEWISE)
    assert run(model_a, config_a, x_a, CUDAGraphMode.PIECEWISE, BatchDescriptor(2)).shape == (2, 8)
    assert run(model_b, config_b, x_b, CUDAGraphMode.PIECEWISE, BatchDescriptor(4)).shape == (4, 16)


def test_capture_after_close_raises(graph_platform):
    config = make_config(CUDAGraphMode.PIECEWISE, [1, 2])
    model = build(config, 1)
    x = torch.randn(2, 8, device=device())
    capture_all(model, config, x, [2], CUDAGraphMode.PIECEWISE)
    StaticGraphSet(static_graph_wrappers(model)).close_capturing()
    with pytest.raises(RuntimeError, match="after capturing was closed"):
        run(model, config, x[:1], CUDAGraphMode.PIECEWISE, BatchDescriptor(1))
    run(model, config, x, CUDAGraphMode.PIECEWISE, BatchDescriptor(2))  # replay still works


def test_copy_inputs_gives_fresh_results_for_fresh_tensors(graph_platform):
    compilation = CompilationConfig(
        backend="eager",
        splitting_ops=[SILLY_OP],
        cudagraph_mode=CUDAGraphMode.PIECEWISE,
        cudagraph_capture_sizes=[2, 4],
        cudagraph_copy_inputs=True,
    )
    config = EngineConfig(
        scheduler_config=SchedulerConfig(max_num_seqs=4), compilation_config=compilation
    )
    model = build(config, 2)
    run(model, config, torch.randn(4, 8, device=device()))  # first call: the largest
    for size in (4, 2):
        run(
            model,
            config,
            torch.randn(size, 8, device=device()),
            CUDAGraphMode.PIECEWISE,
            BatchDescriptor(size),
        )
    fresh = torch.randn(2, 8, device=device())
    expected = run(model, config, fresh).clone()
    replayed = run(model, config, fresh.clone(), CUDAGraphMode.PIECEWISE, BatchDescriptor(2))
    assert torch.equal(replayed, expected)


def test_static_compile_sizes_get_their_own_compile(graph_platform, caplog, monkeypatch):
    compilation = CompilationConfig(
        backend="eager",
        splitting_ops=[SILLY_OP],
        cudagraph_mode=CUDAGraphMode.NONE,
        cudagraph_capture_sizes=[1, 2, 4],
        compile_sizes=[2],
    )
    config = EngineConfig(
        scheduler_config=SchedulerConfig(max_num_seqs=4), compilation_config=compilation
    )
    model = build(config, 1)
    monkeypatch.setattr(logging.getLogger("pieceworks"), "propagate", True)
    caplog.set_level(logging.DEBUG, logger="pieceworks.core.piecewise_backend")
    with compilation_counter.expect(num_eager_compiles=2):  # dynamic shape, 2 pieces
        run(model, config, torch.randn(4, 8, device=device()))
    with compilation_counter.expect(num_eager_compiles=2):  # size 2: one static compile a piece
        run(model, config, torch.randn(2, 8, device=device()))
    with compilation_counter.expect(num_eager_compiles=0):  # compiled once, reused
        run(model, config, torch.randn(2, 8, device=device()))
        run(model, config, torch.randn(1, 8, device=device()))  # not a compile size: dynamic
    compiled = {r.getMessage() for r in caplog.records if r.message.startswith("compiling")}
    assert compiled == {f"compiling piece {i}/2 for static size 2" for i in (1, 2)}


def test_a_piece_without_example_inputs_or_a_loaded_artifact_is_refused():
    graph = torch.fx.symbolic_trace(lambda x: x * 2)
    config = make_config(CUDAGraphMode.NONE, [1, 2])
    manager = CompilerManager(EagerAdaptor(), None)
    with pytest.raises(AssertionError, match="^compiling needs the piece's example inputs$"):
        PiecewiseBackend(graph, config, 0, 1, [0], manager)
    loaded = PiecewiseBackend(graph, config, 0, 1, [], manager, compiled_general=graph)
    assert loaded.compiled_general is graph and loaded.artifact_keys == {}
    assert loaded.runtime_shape((torch.ones(3),)) is None  # no symbolic size: the general one
