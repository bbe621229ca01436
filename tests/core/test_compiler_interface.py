"""The compiler adaptors: what each compiles, saves and loads, and what it refuses.

``InductorAdaptor`` is compiled against in process, in one test (a compile takes Inductor about
20 s on a small CPU; this file carries no ``inductor`` marker, so the mutation oracle runs it):
two static-size pieces, one returning a single value as ``split_module``'s pieces do and one
returning a tuple, and one dynamic-shape piece through ``torch.compile``.
Proves: the compile runs pieceworks' pass manager and the caller's options, with the
autotuning options for a static size and without them for the dynamic shape; each compile is
counted once; a saved artifact loads back into a callable that returns what the compiled piece
returned, one tensor for a single-value piece and a tuple in order for a tuple piece; the
dynamic piece serves two sizes from one compile. The eager adaptor returns the graph itself and
counts it; the base interface and an unknown backend refuse with messages naming the compiler
and the choices; the Triton version is None without Triton, and Inductor's config hash follows
Inductor's config. Inductor's compile processes are started (and asked whether they are up)
before Dynamo traces a model, and not when its stored graph loads instead.
Run: pytest tests/core/test_compiler_interface.py
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
import torch._inductor.config
import torch.fx

from pieceworks.core import compiler_interface
from pieceworks.core.compiler_interface import (
    CompilerInterface,
    EagerAdaptor,
    InductorAdaptor,
    make_compiler,
)
from pieceworks.core.config import PassConfig
from pieceworks.core.counters import compilation_counter
from pieceworks.core.passes.inductor_pass import InductorPass

NUM_TOKENS = 4


class RecordingPass(InductorPass):
    """Records, for each graph Inductor hands it, whether autotuning was on for that compile."""

    def __init__(self) -> None:
        super().__init__()
        self.max_autotune: list[bool] = []

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.max_autotune.append(torch._inductor.config.max_autotune)


# Unannotated: FX keeps an annotation (a string here) on the placeholders, and Inductor cannot
# pickle it into its cache key, so the piece would compile but save no artifact.
def single_value(x, y):
    return x * 2 + y


def two_values(x, y):
    return x + y, x * y


@dataclass
class Compiled:
    """What the compiles produced, and what the recording passes saw."""

    inputs: list[torch.Tensor]
    in_manager: RecordingPass
    from_options: RecordingPass
    pieces: dict[str, Any] = field(default_factory=dict)
    loaded: dict[str, Any] = field(default_factory=dict)
    num_compiles: list[int] = field(default_factory=list)
    dynamic_outputs: list[torch.Tensor] = field(default_factory=list)


def compile_save_and_load(directory: Path, monkeypatch: pytest.MonkeyPatch) -> Compiled:
    """Each piece compiled once, saved and loaded back, and the dynamic piece compiled and run
    for two sizes (Inductor's caches in a fresh directory, so that a compile runs the passes
    however often the test runs)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(directory / "inductor"))
    adaptor = InductorAdaptor(PassConfig())
    compiled = Compiled(
        inputs=[torch.randn(NUM_TOKENS, 3), torch.randn(NUM_TOKENS, 3)],
        in_manager=RecordingPass(),
        from_options=RecordingPass(),
    )
    adaptor.pass_manager.passes.insert(0, compiled.in_manager)
    for function in (single_value, two_values):
        graph = torch.fx.symbolic_trace(function)
        options = {"post_grad_custom_pre_pass": compiled.from_options}
        before = compilation_counter.num_inductor_compiles
        piece = adaptor.compile(graph, compiled.inputs, options, NUM_TOKENS)
        compiled.num_compiles.append(compilation_counter.num_inductor_compiles - before)
        path = str(directory / function.__name__)
        adaptor.save_artifact(piece, path)
        compiled.pieces[function.__name__] = piece
        compiled.loaded[function.__name__] = adaptor.load_artifact(path, graph)

    def backend(graph: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        before = compilation_counter.num_inductor_compiles
        piece = adaptor.compile(graph, example_inputs, {}, None)
        compiled.num_compiles.append(compilation_counter.num_inductor_compiles - before)
        return piece

    model = torch.compile(lambda x: x.sin() + 1, backend=backend, dynamic=True)
    compiled.dynamic_outputs = [model(torch.arange(float(size))) for size in (5, 7)]
    return compiled


def test_inductor_compiles_saves_and_loads_pieces_in_process(tmp_path, monkeypatch):
    # One test for every Inductor compile: mutmut maps a function only to the test that ran it
    # first, so the test that compiles must check everything the compiles produced.
    inductor = compile_save_and_load(tmp_path, monkeypatch)
    # One graph per compile reaches the manager: two static pieces, then the dynamic one; the
    # caller's options reach Inductor too, and autotuning is on for the static sizes only.
    assert inductor.in_manager.max_autotune == [True, True, False]
    assert inductor.from_options.max_autotune == [True, True]
    # Each compile counted once (the dynamic piece compiled once for both sizes).
    assert inductor.num_compiles == [1, 1, 1]
    for output, size in zip(inductor.dynamic_outputs, (5, 7), strict=True):
        torch.testing.assert_close(output, torch.arange(float(size)).sin() + 1)

    x, y = inductor.inputs
    single = inductor.loaded["single_value"](x, y)
    assert isinstance(single, torch.Tensor)  # not the artifact's 1-list
    torch.testing.assert_close(single, x * 2 + y)
    torch.testing.assert_close(inductor.pieces["single_value"](x, y), x * 2 + y)

    pair = inductor.loaded["two_values"](x, y)
    assert isinstance(pair, tuple) and len(pair) == 2
    torch.testing.assert_close(pair[0], x + y)
    torch.testing.assert_close(pair[1], x * y)
    torch.testing.assert_close(list(inductor.pieces["two_values"](x, y)), list(pair))


def test_the_eager_adaptor_returns_the_graph_and_counts_it():
    graph = torch.fx.symbolic_trace(single_value)
    adaptor = make_compiler("eager")
    assert (adaptor.name, adaptor.saves_artifacts) == ("eager", False)
    with compilation_counter.expect(num_eager_compiles=1, num_inductor_compiles=0):
        assert adaptor.compile(graph, [], {}, None) is graph
    assert isinstance(adaptor, EagerAdaptor)
    with pytest.raises(NotImplementedError) as saving:
        adaptor.save_artifact(graph, "piece")
    assert str(saving.value) == "the eager compiler saves no artifacts"
    with pytest.raises(NotImplementedError) as loading:
        adaptor.load_artifact("piece", graph)
    assert str(loading.value) == "the eager compiler loads no artifacts"


def test_the_base_interface_compiles_nothing_and_names_itself():
    base = CompilerInterface()
    graph = torch.fx.symbolic_trace(single_value)
    assert (base.name, base.saves_artifacts) == ("base", False)
    assert base.compute_hash_factors() == {"name": "base"}
    with pytest.raises(NotImplementedError):
        base.compile(graph, [], {}, None)
    with pytest.raises(NotImplementedError) as loading:
        base.load_artifact("piece", graph)
    assert str(loading.value) == "the base compiler loads no artifacts"
    with pytest.raises(NotImplementedError) as saving:
        base.save_artifact(graph, "piece")
    assert str(saving.value) == "the base compiler saves no artifacts"


def test_inductor_saves_artifacts_and_runs_the_passes_of_its_config():
    adaptor = make_compiler("inductor", PassConfig(enable_noop=False, enable_fusion=False))
    assert isinstance(adaptor, InductorAdaptor)
    assert (adaptor.name, adaptor.saves_artifacts) == ("inductor", True)
    assert adaptor.pass_manager.pass_config == PassConfig(enable_noop=False, enable_fusion=False)
    assert InductorAdaptor().pass_manager.pass_config == PassConfig()


def test_an_unknown_backend_is_refused_with_the_choices():
    with pytest.raises(ValueError) as refused:
        make_compiler("tvm")
    assert str(refused.value) == "compile backend 'tvm' unknown; use one of ['eager', 'inductor']"


def test_the_triton_version_is_none_without_triton(monkeypatch):
    import triton

    assert compiler_interface.triton_version() == str(triton.__version__)
    monkeypatch.setitem(sys.modules, "triton", None)  # import triton raises ImportError
    assert compiler_interface.triton_version() is None


def test_the_inductor_config_hash_follows_inductor_s_config():
    default = compiler_interface._inductor_config_hash()
    assert compiler_interface._inductor_config_hash() == default
    with torch._inductor.config.patch(max_autotune_gemm=True):
        assert compiler_interface._inductor_config_hash() != default
    assert compiler_interface._inductor_config_hash() == default


def test_inductor_starts_its_compile_processes_and_asks_whether_they_are_up(monkeypatch):
    import torch._inductor.async_compile as async_compile

    calls = []
    monkeypatch.setattr(async_compile, "maybe_warm_pool", lambda: calls.append("start"))
    monkeypatch.setattr(
        async_compile.AsyncCompile, "use_process_pool", classmethod(lambda cls: calls.append("ask"))
    )
    InductorAdaptor().start_workers()
    assert calls == ["start", "ask"]
    CompilerInterface().start_workers()  # nothing to start
    EagerAdaptor().start_workers()
    assert calls == ["start", "ask"]


def test_compile_workers_start_before_a_trace_and_not_for_a_stored_graph(
    monkeypatch, graph_platform, tmp_path
):
    from pieceworks.benchmarks.modes import compilation_for_mode
    from pieceworks.engine.llm import LLM

    traces_when_started = []
    monkeypatch.setattr(
        EagerAdaptor,
        "start_workers",
        lambda self: traces_when_started.append(compilation_counter.num_dynamo_traces),
    )
    monkeypatch.setenv("PIECEWORKS_CACHE_ROOT", str(tmp_path))
    monkeypatch.delenv("PIECEWORKS_DISABLE_COMPILE_CACHE")  # the suite's default: no cache
    compilation = compilation_for_mode("piecewise", {"backend": "eager"})
    before = compilation_counter.num_dynamo_traces
    LLM("llama-tiny", compilation_config=compilation, max_num_seqs=2).shutdown()
    assert traces_when_started == [before]  # once, before the trace
    assert compilation_counter.num_dynamo_traces == before + 1
    LLM("llama-tiny", compilation_config=compilation, max_num_seqs=2).shutdown()
    assert traces_when_started == [before]  # the warm start loaded the stored graph
    assert compilation_counter.num_dynamo_traces == before + 1
