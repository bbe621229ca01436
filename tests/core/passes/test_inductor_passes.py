"""The passes inside the real pipeline: Inductor calls the manager on every piece.

A toy model split at the silly attention op holds, inside its pieces, a mutating op writing into
a fresh buffer, an RMSNorm -> FP8 quant and a residual-add RMSNorm -> FP8 quant. Compiled with
Inductor (``standalone_compile``, torch's own FX cache off so the passes really run), every piece
must reach ``PostGradPassManager`` with auto-functionalization v1, leave it with no
``auto_functionalized`` and no clone, the raw op and both fused ops present, and compute what the
eager model computes. One module-scoped compile (Inductor is slow on small CPUs).
Run: pytest tests/core/passes/test_inductor_passes.py
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pieceworks.config import EngineConfig, SchedulerConfig
from pieceworks.core.config import CompilationConfig, CompilationLevel, CUDAGraphMode, PassConfig
from pieceworks.core.counters import compilation_counter
from pieceworks.core.decorators import support_torch_compile
from pieceworks.core.forward_context import set_forward_context
from pieceworks.core.norm_quant import add_rms_norm, rms_norm, static_scaled_fp8_quant
from pieceworks.core.passes.pass_manager import PostGradPassManager
from pieceworks.kernels.norm_quant.norm_quant_ops import register_norm_quant_ops
from tests.core.passes.graph_backend import op_counts
from tests.core.passes.test_fix_functionalization import scale_into_op
from tests.core.toy_model import SILLY_OP, silly_attention_op

pytestmark = pytest.mark.inductor
HIDDEN, EPS = 32, 1e-5


@support_torch_compile
class NormQuantToy(nn.Module):
    """Piece 0: mutating op, norm -> quant. Piece 1: residual norm -> quant. Split between."""

    def __init__(self, *, config: EngineConfig, prefix: str = "") -> None:
        super().__init__()
        register_norm_quant_ops()
        self.scale_into = scale_into_op()
        self.attention = silly_attention_op()
        self.norm_weight = nn.Parameter(1 + 0.1 * torch.randn(HIDDEN), requires_grad=False)
        self.input_scale = nn.Parameter(torch.tensor(0.02), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        doubled = torch.empty_like(x)
        self.scale_into(x, doubled)  # writes 2 * x into a buffer made inside the piece
        first = static_scaled_fp8_quant(rms_norm(doubled, self.norm_weight, EPS), self.input_scale)
        attended = torch.empty_like(x)
        self.attention(x, x, x, attended)  # the split point
        normed, residual = add_rms_norm(attended, doubled, self.norm_weight, EPS)
        second = static_scaled_fp8_quant(normed, self.input_scale)
        return first.to(x.dtype) + second.to(x.dtype) + residual


def make_config(level: CompilationLevel) -> EngineConfig:
    compilation = CompilationConfig(
        level=level,
        backend="inductor",
        splitting_ops=[SILLY_OP],
        cudagraph_mode=CUDAGraphMode.NONE,
        pass_config=PassConfig(enable_noop=True, enable_fusion=True),
        inductor_compile_config={"fx_graph_cache": False},  # a cache hit would skip the passes
    )
    return EngineConfig(
        scheduler_config=SchedulerConfig(max_num_seqs=4), compilation_config=compilation
    )


@pytest.fixture(scope="module")
def compiled():
    """(graphs after the passes, compiled model, eager model, config), built once."""
    seen: list[tuple] = []
    original_call = PostGradPassManager.__call__

    def spy(manager: PostGradPassManager, graph: torch.fx.Graph) -> None:
        before = op_counts(graph)
        original_call(manager, graph)
        seen.append((before, op_counts(graph)))

    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setattr(PostGradPassManager, "__call__", spy)
    config = make_config(CompilationLevel.PIECEWISE)
    torch.manual_seed(0)
    model = NormQuantToy(config=config)
    x = torch.randn(6, HIDDEN)
    with compilation_counter.expect(num_inductor_compiles=2), set_forward_context(None, config):
        with torch.no_grad():
            model(x)  # 1 split op: 2 capturable pieces, each compiled once
    monkeypatch.undo()
    eager = NormQuantToy(config=make_config(CompilationLevel.NO_COMPILATION))
    eager.load_state_dict(model.state_dict())
    yield seen, model, eager, config


def test_every_piece_went_through_the_passes(compiled):
    seen = compiled[0]
    assert len(seen) == 2  # one post-grad graph per piece
    first_before, first_after = seen[0]
    # v1 wrappers, not auto_functionalized_v2: the toy's own mutating op, and the fused norm the
    # joint-graph fusion already put in (PostGradPassManager.joint_passes)
    assert first_before["auto_functionalized"] == 2
    assert first_before["pieceworks.rms_norm_static_fp8_quant.default"] == 0  # still wrapped
    assert first_before["aten.rsqrt.default"] == 0  # fused before the post-grad graph
    assert first_before["auto_functionalized_v2"] == 0
    for _, after in seen:
        assert after["auto_functionalized"] == 0 and after["aten.clone.default"] == 0


def test_raw_op_in_place_and_both_fusions_in_the_compiled_pieces(compiled):
    (_, first_after), (_, second_after) = compiled[0]
    assert first_after["passes_toy.scale_into.default"] == 1
    assert first_after["pieceworks.rms_norm_static_fp8_quant.default"] == 1
    assert second_after["pieceworks.fused_add_rms_norm_static_fp8_quant.default"] == 1
    for after in (first_after, second_after):
        assert after["aten.rsqrt.default"] == 0  # no unfused norm left


@pytest.mark.parametrize("num_tokens", [1, 6, 11])
def test_compiled_equals_eager(compiled, num_tokens):
    _, model, eager, config = compiled
    x = torch.randn(num_tokens, HIDDEN)
    with set_forward_context(None, config), torch.no_grad():
        torch.testing.assert_close(model(x), eager(x), rtol=1e-5, atol=1e-5)
