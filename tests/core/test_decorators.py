"""``support_torch_compile`` at each level: guards really dropped at 2/3, recompiles at 1, opt-out.

A model whose output depends on a Python branch on the token count shows it: at levels 2 and 3 the
branch taken at trace time stays frozen (no guard is evaluated), at level 1 Dynamo re-traces.
Dimensions declared dynamic are traced once for every size: Dynamo converts no frame again (a
bytecode hook counts its conversions), also at level 1 where guards are evaluated. The first
call's times add up (trace and compile within the call; a warm start's graph load and rebuild
likewise), and the debug dump holds the split graph and Dynamo's transformed code. A first call
by keyword passes every argument; a level-1 model is counted and reports no first-call times. A
model with no dynamic dims is refused, and the forward context read outside one, each saying what
to do, and so is a dynamic dim naming no argument. Every tensor annotation (plain or optional) is
dynamic in dim 0, a list of dims marks each; each compiled instance is counted once; a compiled
module inside a compiled one is traced into the outer graph, its own compiler never run.
Run: pytest tests/core/test_decorators.py
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Optional

import pytest
import torch
from torch import nn

from pieceworks.config import EngineConfig
from pieceworks.core.config import CompilationConfig, CompilationLevel, CUDAGraphMode
from pieceworks.core.counters import compilation_counter
from pieceworks.core.decorators import (
    _annotated_dynamic_dims,
    ignore_torch_compile,
    support_torch_compile,
)
from pieceworks.core.forward_context import get_forward_context, set_forward_context
from pieceworks.core.trace_once import trace_once_compilers
from pieceworks.platforms import current_platform
from tests.core.cache.compile_cache_worker import toy_config
from tests.core.toy_model import SILLY_OP, ShapeBranchModel, ToyModel

pytestmark = pytest.mark.platform_agnostic


def config_at(level: CompilationLevel, mode: CUDAGraphMode = CUDAGraphMode.NONE) -> EngineConfig:
    return EngineConfig(
        compilation_config=CompilationConfig(
            level=level, backend="eager", splitting_ops=[SILLY_OP], cudagraph_mode=mode
        )
    )


def call(model, config, x):
    with set_forward_context(None, config):
        return model(x)


@contextlib.contextmanager
def dynamo_conversions() -> Iterator[list[str]]:
    """The names of the frames Dynamo converts (traces) inside the block."""
    converted: list[str] = []

    def hook(code, new_code):
        converted.append(code.co_name)
        return None

    handle = torch._dynamo.convert_frame.register_bytecode_hook(hook)
    try:
        yield converted
    finally:
        handle.remove()


@pytest.mark.parametrize("level", [CompilationLevel.DYNAMO_ONCE, CompilationLevel.PIECEWISE])
def test_guards_are_dropped_after_the_first_trace(level):
    config = config_at(level)
    model = ShapeBranchModel(config=config)
    assert torch.equal(call(model, config, torch.zeros(8, 2)), torch.full((8, 2), 100.0))
    with compilation_counter.expect(num_graphs_seen=0):
        frozen = call(model, config, torch.zeros(2, 2))
    assert torch.equal(frozen, torch.full((2, 2), 100.0))  # the traced branch, not the eager one


def test_level_1_evaluates_guards_and_recompiles():
    config = config_at(CompilationLevel.DYNAMO_AS_IS)
    model = ShapeBranchModel(config=config)
    assert torch.equal(call(model, config, torch.zeros(8, 2)), torch.full((8, 2), 100.0))
    assert torch.equal(call(model, config, torch.zeros(2, 2)), torch.full((2, 2), -100.0))


def test_trace_once_after_a_level_1_model_of_the_same_class():
    """Dynamo's cache entry of the level-1 model must not stand in for the level-2 trace."""
    as_is = config_at(CompilationLevel.DYNAMO_AS_IS)
    traced = call(ShapeBranchModel(config=as_is), as_is, torch.zeros(8, 2))
    assert torch.equal(traced, torch.full((8, 2), 100.0))
    once = config_at(CompilationLevel.DYNAMO_ONCE)
    model = ShapeBranchModel(config=once)
    with dynamo_conversions() as converted:
        assert torch.equal(call(model, once, torch.zeros(8, 2)), torch.full((8, 2), 100.0))
    assert converted == ["forward"]
    assert torch.equal(call(model, once, torch.zeros(2, 2)), torch.full((2, 2), 100.0))  # frozen


def test_level_0_is_eager():
    config = config_at(CompilationLevel.NO_COMPILATION)
    with compilation_counter.expect(num_models_seen=0, num_graphs_seen=0):
        model = ShapeBranchModel(config=config)
        assert torch.equal(call(model, config, torch.zeros(2, 2)), torch.full((2, 2), -100.0))


@ignore_torch_compile
class EagerToyModel(ToyModel):
    """Opted out: the subclass of a decorated class runs eagerly."""


def test_opted_out_subclass_is_not_compiled():
    config = config_at(CompilationLevel.PIECEWISE)
    device = current_platform().device()
    with compilation_counter.expect(num_models_seen=0, num_graphs_seen=0):
        model = EagerToyModel(config=config, num_layers=2).to(device)
        call(model, config, torch.randn(3, 8, device=device))
    with compilation_counter.expect(num_models_seen=1, num_graphs_seen=1):
        compiled = ToyModel(config=config, num_layers=2).to(device)
        call(compiled, config, torch.randn(3, 8, device=device))


def test_a_model_with_no_dynamic_dims_is_refused_with_what_to_do():
    class Untyped(nn.Module):
        def forward(self, x, scale: float = 2.0):
            return x * scale

    expected = (
        "support_torch_compile on Untyped: no dynamic dims. Annotate forward's tensor arguments "
        "as torch.Tensor or pass dynamic_arg_dims"
    )
    with pytest.raises(ValueError) as refused:
        support_torch_compile(Untyped)
    assert str(refused.value) == expected


def test_the_forward_context_read_outside_one_says_what_to_do():
    with pytest.raises(RuntimeError) as refused:
        get_forward_context()
    assert str(refused.value) == "no forward context: run the model inside set_forward_context(...)"


@pytest.mark.parametrize("level", [CompilationLevel.DYNAMO_AS_IS, CompilationLevel.DYNAMO_ONCE])
def test_explicit_dynamic_arg_dims_and_validation(level):
    @support_torch_compile(dynamic_arg_dims={"x": 0})
    class Explicit(nn.Module):
        def __init__(self, *, config, prefix=""):
            super().__init__()

        def forward(self, x, scale: float = 2.0):
            return x * scale

    config = config_at(level)
    model = Explicit(config=config)
    with dynamo_conversions() as first:
        assert torch.equal(call(model, config, torch.ones(3)), torch.full((3,), 2.0))
    assert first == ["forward"]
    # dim 0 was traced as dynamic: a new size needs no re-trace even where guards are evaluated
    # (level 1); a graph specialised to size 3 would fail its guard there and be traced again.
    with dynamo_conversions() as second:
        assert torch.equal(call(model, config, torch.ones(5)), torch.full((5,), 2.0))
    assert second == []

    with pytest.raises(ValueError, match="not an argument"):
        support_torch_compile(dynamic_arg_dims={"y": 0})(Explicit)


def test_none_argument_stays_none():
    @support_torch_compile
    class MaybeResidual(nn.Module):
        def __init__(self, *, config, prefix=""):
            super().__init__()

        def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
            return x if residual is None else x + residual

    config = config_at(CompilationLevel.DYNAMO_ONCE)
    model = MaybeResidual(config=config)
    assert torch.equal(call(model, config, torch.ones(4)), torch.ones(4))
    assert torch.equal(call(model, config, torch.ones(2)), torch.ones(2))


@pytest.mark.parametrize("level", [CompilationLevel.DYNAMO_ONCE, CompilationLevel.PIECEWISE])
def test_a_first_call_by_keyword_passes_every_argument(level):
    @support_torch_compile
    class Scaled(nn.Module):
        def __init__(self, *, config, prefix=""):
            super().__init__()

        def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
            return x * scale

    config = config_at(level)
    model = Scaled(config=config)
    with set_forward_context(None, config):
        first = model(x=torch.ones(3), scale=torch.full((3,), 2.0))
        later = model(torch.ones(5), scale=torch.full((5,), 3.0))
    assert torch.equal(first, torch.full((3,), 2.0))
    assert torch.equal(later, torch.full((5,), 3.0))


def test_attribute_assignment_in_forward_raises_with_static_graphs(graph_platform):
    @support_torch_compile
    class Mutating(nn.Module):
        def __init__(self, *, config, prefix=""):
            super().__init__()
            self.register_buffer("last", torch.zeros(1))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.last = x.sum().reshape(1)
            return x * 2

    config = config_at(CompilationLevel.PIECEWISE, CUDAGraphMode.PIECEWISE)
    with pytest.raises(RuntimeError, match="assigns module attributes or buffers"):
        call(Mutating(config=config), config, torch.ones(3))
    allowed = config_at(CompilationLevel.PIECEWISE, CUDAGraphMode.NONE)  # no static graphs
    output = call(Mutating(config=allowed), allowed, torch.ones(3))
    assert torch.equal(output, torch.full((3,), 2.0))


def test_the_buffer_assignment_refusal_says_what_to_do_and_shows_the_code(graph_platform):
    @support_torch_compile
    class Counting(nn.Module):
        def __init__(self, *, config, prefix=""):
            super().__init__()
            self.register_buffer("seen", torch.zeros(1))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.seen = self.seen + x.shape[0]
            return x + 1

    config = config_at(CompilationLevel.PIECEWISE, CUDAGraphMode.PIECEWISE)
    with pytest.raises(RuntimeError) as raised:
        call(Counting(config=config), config, torch.ones(3))
    message = str(raised.value)
    head, code = message.split("Transformed code (look for `update`):\n")
    assert head == (
        "Counting.forward assigns module attributes or buffers during the forward pass; with "
        "static graphs the assignment would be frozen into the graph and silently go stale. "
        "Keep state in tensors updated in place, or set cudagraph_mode=NONE. "
    )
    assert "LOAD_ATTR" in code and "update" in code  # the bytecode (depyf is not installed)


def test_trace_once_compilers_lists_each_compiled_module():
    config = config_at(CompilationLevel.PIECEWISE)
    model = ToyModel(config=config, num_layers=1)
    assert trace_once_compilers(model) == [model._pieceworks_compiler]
    eager = config_at(CompilationLevel.NO_COMPILATION)
    assert trace_once_compilers(ToyModel(config=eager, num_layers=1)) == []


def first_call_of(config: EngineConfig):
    """A 2-layer toy's ``TraceOnceCompiler`` after one call of 4 tokens on the platform's device
    (the split op is registered for its dispatch key)."""
    device = current_platform().device()
    model = ToyModel(config=config, num_layers=2).to(device)
    call(model, config, torch.randn(4, 8, device=device))
    return model._pieceworks_compiler


def test_the_first_calls_times_add_up_traced_and_warm(tmp_path, monkeypatch):
    monkeypatch.delenv("PIECEWORKS_DISABLE_COMPILE_CACHE", raising=False)
    config = toy_config(str(tmp_path), backend="eager")
    traced = first_call_of(config)
    assert traced.warm_forward is None and traced.graph_load_seconds == 0.0
    assert 0 < traced.trace_seconds and 0 < traced.compile_seconds
    assert traced.trace_seconds + traced.compile_seconds <= traced.first_call_seconds
    assert traced.compile_seconds == traced.piecewise_backend.backend_seconds
    warm = first_call_of(config)
    assert warm.warm_forward is not None and warm.trace_seconds == 0.0
    assert 0 < warm.graph_load_seconds and 0 < warm.compile_seconds
    assert warm.graph_load_seconds + warm.compile_seconds <= warm.first_call_seconds
    assert warm.compile_seconds == warm.piecewise_backend.backend_seconds


def test_a_level_1_model_is_counted_and_reports_no_first_call_times():
    """Level 1 hands every call to Dynamo (no first call of its own): each time stays 0."""
    config = config_at(CompilationLevel.DYNAMO_AS_IS)
    with compilation_counter.expect(dynamo_as_is_count=1):
        model = ShapeBranchModel(config=config)
    call(model, config, torch.zeros(8, 2))
    compiler = model._pieceworks_compiler
    times = (compiler.first_call_seconds, compiler.trace_seconds, compiler.graph_load_seconds)
    assert times + (compiler.compile_seconds,) == (0.0, 0.0, 0.0, 0.0)


def test_debug_dump_holds_the_split_graph_and_the_transformed_code(tmp_path):
    config = config_at(CompilationLevel.PIECEWISE)
    config.compilation_config.debug_dump_path = str(tmp_path)
    first_call_of(config)
    graph = (tmp_path / "rank_0" / "computation_graph.py").read_text()
    assert "class GraphModule" in graph and "submod_4" in graph  # 2L+1 = 5 pieces
    code = Path(tmp_path / "rank_0" / "transformed_code.py").read_text()
    assert "__compiled_fn" in code  # Dynamo's bytecode calls the compiled graph


def test_a_warm_start_writes_the_split_graph_to_the_debug_dump_too(tmp_path, monkeypatch):
    monkeypatch.delenv("PIECEWORKS_DISABLE_COMPILE_CACHE", raising=False)
    config = toy_config(str(tmp_path / "cache"), backend="eager")
    config.compilation_config.debug_dump_path = str(tmp_path / "dump")
    first_call_of(config)
    graph_file = tmp_path / "dump" / "rank_0" / "computation_graph.py"
    assert "submod_4" in graph_file.read_text()
    graph_file.unlink()
    assert first_call_of(config).warm_forward is not None
    rebuilt = graph_file.read_text()  # the stored graph (no example values: no shape notes)
    assert "class GraphModule" in rebuilt and "submod_4" in rebuilt


def test_the_debug_dump_is_logged_and_not_printed(tmp_path, caplog, capsys, monkeypatch):
    monkeypatch.setattr(logging.getLogger("pieceworks"), "propagate", True)
    caplog.set_level(logging.INFO, logger="pieceworks.core.backend")
    config = config_at(CompilationLevel.PIECEWISE)
    config.compilation_config.debug_dump_path = str(tmp_path)
    first_call_of(config)
    messages = {record.getMessage() for record in caplog.records}
    assert f"split graph written to {tmp_path / 'rank_0'}" in messages
    assert "class GraphModule" not in capsys.readouterr().out


def test_a_dynamic_dim_that_names_no_argument_is_refused_in_full():
    class Scaled(nn.Module):
        def forward(self, x):
            return x

    with pytest.raises(ValueError) as refused:
        support_torch_compile(dynamic_arg_dims={"hidden": 0})(Scaled)
    assert str(refused.value) == (
        "dynamic_arg_dims names 'hidden', which is not an argument of Scaled.forward"
    )


def test_every_tensor_annotation_is_dynamic_in_dim_0_and_nothing_else():
    class Annotated(nn.Module):
        def forward(
            self,
            x: torch.Tensor,
            residual: torch.Tensor | None,
            positions: Optional[torch.Tensor],  # noqa: UP045 (the form the decorator reads too)
            scale: float,
            names: list[torch.Tensor],
        ) -> torch.Tensor:
            return x

    assert _annotated_dynamic_dims(Annotated) == {"x": 0, "residual": 0, "positions": 0}


def test_the_decorator_returns_the_class_with_or_without_arguments():
    class Plain(nn.Module):
        def __init__(self, *, config, prefix=""):
            super().__init__()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x

    assert support_torch_compile(Plain) is Plain
    assert support_torch_compile(dynamic_arg_dims={"x": 0})(Plain) is Plain


def test_each_compiled_instance_is_counted_once_and_an_opted_out_one_not():
    config = config_at(CompilationLevel.DYNAMO_ONCE)
    with compilation_counter.expect(num_models_seen=2):
        first, second = ShapeBranchModel(config=config), ShapeBranchModel(config=config)
    assert first._pieceworks_compiler is not second._pieceworks_compiler
    with compilation_counter.expect(num_models_seen=0):
        opted_out = EagerToyModel(config=config, num_layers=1)
    assert opted_out._pieceworks_compiler is None


def test_a_dim_list_marks_each_dim_dynamic():
    @support_torch_compile(dynamic_arg_dims={"x": [0, 1]})
    class Summed(nn.Module):
        def __init__(self, *, config, prefix=""):
            super().__init__()

        def forward(self, x):
            return x.sum(dim=1)

    config = config_at(CompilationLevel.DYNAMO_AS_IS)
    model = Summed(config=config)
    assert torch.equal(call(model, config, torch.ones(2, 3)), torch.full((2,), 3.0))
    # Both dims traced as dynamic: a new size of either needs no re-trace where guards run.
    with dynamo_conversions() as converted:
        assert torch.equal(call(model, config, torch.ones(4, 5)), torch.full((4,), 5.0))
    assert converted == []


@support_torch_compile
class Inner(nn.Module):
    def __init__(self, *, config, prefix=""):
        super().__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 1


@support_torch_compile
class Outer(nn.Module):
    def __init__(self, *, config, prefix=""):
        super().__init__()
        self.inner = Inner(config=config, prefix=f"{prefix}.inner")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x) * 2


def test_a_compiled_module_inside_a_compiled_one_is_traced_into_its_graph():
    config = config_at(CompilationLevel.DYNAMO_ONCE)
    with compilation_counter.expect(num_models_seen=2):
        model = Outer(config=config)
    with dynamo_conversions() as converted:
        assert torch.equal(call(model, config, torch.zeros(3)), torch.full((3,), 2.0))
    assert converted == ["forward"]  # one trace: the inner forward ran inside it
    assert not model.inner._pieceworks_compiler.is_ready  # the inner compiler never ran
