"""The pipeline with Inductor: pieces compiled by ``standalone_compile``, replay equals compiled.

One module-scoped model keeps Inductor's cost (tens of seconds on a small CPU) paid once.
Also: the debug dump. Static ``compile_sizes`` (eager backend): ``tests/core/test_piecewise.py``.
Run: pytest tests/core/test_inductor_pipeline.py
"""

from __future__ import annotations

import os

import pytest
import torch

from pieceworks.config import EngineConfig, SchedulerConfig
from pieceworks.core.config import CompilationConfig, CUDAGraphMode
from pieceworks.core.counters import compilation_counter
from pieceworks.core.forward_context import BatchDescriptor
from tests.core.test_piecewise import build, capture_all, device, run
from tests.core.toy_model import SILLY_OP

pytestmark = [pytest.mark.platform_agnostic, pytest.mark.inductor]
NUM_LAYERS, SIZES = 2, [1, 2]


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """(config, model, static input, eager reference model), captured once for the module."""
    monkeypatch = pytest.MonkeyPatch()
    from pieceworks import platforms

    if not platforms.current_platform().supports_static_graphs():
        from pieceworks_simgraph.platform import SimGraphPlatform

        monkeypatch.setattr(platforms, "_current", SimGraphPlatform())
    dump = str(tmp_path_factory.mktemp("dump"))
    compilation = CompilationConfig(
        backend="inductor",
        splitting_ops=[SILLY_OP],
        cudagraph_mode=CUDAGraphMode.PIECEWISE,
        cudagraph_capture_sizes=SIZES,
        debug_dump_path=dump,
    )
    config = EngineConfig(
        scheduler_config=SchedulerConfig(max_num_seqs=2), compilation_config=compilation
    )
    model = build(config, NUM_LAYERS)
    static_x = torch.randn(max(SIZES), 8, device=device())
    with compilation_counter.expect(
        num_inductor_compiles=NUM_LAYERS + 1,  # one per piece
        num_backend_compilations=NUM_LAYERS + 1,
        num_cudagraph_captured=len(SIZES) * (NUM_LAYERS + 1),
    ):
        capture_all(model, config, static_x, SIZES, CUDAGraphMode.PIECEWISE)
    eager_config = EngineConfig(compilation_config=CompilationConfig(level=0))
    yield config, model, static_x, build(eager_config, NUM_LAYERS), dump
    monkeypatch.undo()


@torch.inference_mode()
def test_inductor_replay_matches_compiled_and_eager(compiled):
    config, model, static_x, eager_model, _ = compiled
    for size in SIZES:
        static_x[:size].copy_(torch.randn(size, 8))
        no_graph = run(model, config, static_x[:size]).clone()
        replayed = run(
            model, config, static_x[:size], CUDAGraphMode.PIECEWISE, BatchDescriptor(size)
        ).clone()
        assert torch.equal(replayed, no_graph)
        torch.testing.assert_close(replayed, eager_model(static_x[:size]), rtol=1e-5, atol=1e-5)


def test_debug_dump_written(compiled):
    dump = compiled[-1]
    graph_file = os.path.join(dump, "rank_0", "computation_graph.py")
    code_file = os.path.join(dump, "rank_0", "transformed_code.py")
    assert "submod_1" in open(graph_file).read()
    assert os.path.getsize(code_file) > 0
