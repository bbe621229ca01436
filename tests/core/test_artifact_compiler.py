"""The compile cache's artifact path on the CPU in seconds: a compiler that saves artifacts.

Inductor is the only compiler in the tree that saves artifacts, and a compile takes it tens of
seconds on a small CPU (``test_warm_start.py`` runs it). ``SavingEagerAdaptor`` is the eager
compiler with artifacts (a piece's artifact is its graph's code, and loading checks the code),
so every step Inductor's artifacts take runs here in process on the toy (eager arithmetic, 3
layers: 4 capturable pieces, 3 distinct structures, since the two middle pieces are identical).
Proves: a cold start compiles each distinct structure once and saves it (the twins share one
artifact); a second start loads the stored graph and every artifact and compiles nothing; an
artifact that fails its checksum is named in a warning, the start traces, compiles that
structure alone, loads the rest, and the next start is warm again; an intact artifact that does
not load is named and the start traces, building each piece once even when others loaded before
it; a compile cache that cannot be opened is named with what
to do, and a stored graph then cannot load its artifacts (the start traces and compiles); the
cache directory holds its key factors and the log names it; a torch that does not report the
traced files leaves the cache off, saying so; with piecewise graphs and a static
compile size (the simgraph platform on CPU), a warm start wraps the pieces as the traced start
did and loads the static size's artifacts when that size first runs; an artifact that cannot be
saved is named in a warning and the model runs; outputs always equal the cold start's.
Run: pytest tests/core/test_artifact_compiler.py
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from pieceworks.config import EngineConfig, SchedulerConfig
from pieceworks.core import backend as backend_module
from pieceworks.core.compiler_interface import EagerAdaptor
from pieceworks.core.config import CompilationConfig, CUDAGraphMode
from pieceworks.core.counters import compilation_counter
from pieceworks.core.decorators import piecewise_backends
from tests.core.cache.compile_cache_worker import assert_same_outputs, run_toy
from tests.core.test_piecewise import build, run
from tests.core.toy_model import SILLY_OP

NUM_LAYERS = 3
NUM_CAPTURABLE = NUM_LAYERS + 1
NUM_DISTINCT = 3  # first piece, the middle structure (2 pieces), last piece


class SavingEagerAdaptor(EagerAdaptor):
    """The eager compiler with artifacts: a piece's artifact is its graph's code."""

    name = "eager-with-artifacts"
    saves_artifacts = True

    def save_artifact(self, compiled: Any, path: str) -> None:
        Path(path).write_text(compiled.code)

    def load_artifact(self, path: str, graph: torch.fx.GraphModule) -> Any:
        if Path(path).read_text() != graph.code:
            raise ValueError(f"{path} is not the code of this piece")
        return graph


@pytest.fixture(autouse=True)
def saving_compiler(monkeypatch):
    """The saving compiler in place of the eager one (every test also takes ``log_text``, from
    ``tests/core/conftest.py``: the cache on, the log's text)."""
    monkeypatch.setattr(backend_module, "make_compiler", lambda *_: SavingEagerAdaptor())


def start(root: Path) -> dict:
    return run_toy(str(root), NUM_LAYERS, backend="eager")


def test_a_cold_start_saves_one_artifact_per_distinct_piece(tmp_path, log_text):
    cold = start(tmp_path)
    counters = cold["counters"]
    assert counters["num_dynamo_traces"] == 1
    assert counters["num_backend_compilations"] == NUM_CAPTURABLE
    assert counters["num_eager_compiles"] == NUM_DISTINCT  # the twins share one compile
    assert counters["num_compiled_artifacts_saved"] == NUM_DISTINCT
    assert counters["num_compiled_artifacts_loaded"] == 0
    assert counters["num_traced_graphs_saved"] == 1
    entries = json.loads((Path(cold["cache_dir"]) / "index.json").read_text())["entries"]
    assert sorted(entries) == [f"piece_{i}/general" for i in range(NUM_CAPTURABLE)]
    assert entries["piece_1/general"] == entries["piece_2/general"]  # one artifact file
    assert len({entry["artifact"] for entry in entries.values()}) == NUM_DISTINCT
    assert f"compile cache: {cold['cache_dir']}" in log_text()
    assert "compile cache miss (compiling every piece)" in log_text()


def test_a_second_start_loads_every_artifact_and_compiles_nothing(tmp_path, log_text):
    cold = start(tmp_path)
    warm = start(tmp_path)
    counters = warm["counters"]
    assert (counters["num_dynamo_traces"], counters["num_traced_graphs_loaded"]) == (0, 1)
    assert counters["num_eager_compiles"] == 0
    assert counters["num_compiled_artifacts_loaded"] == NUM_DISTINCT  # the twins load one
    assert counters["num_compiled_artifacts_saved"] == 0
    assert counters["num_backend_compilations"] == NUM_CAPTURABLE
    assert warm["cache_dir"] == cold["cache_dir"]
    assert_same_outputs(warm, cold)


def test_a_damaged_artifact_is_named_compiled_again_and_the_next_start_is_warm(tmp_path, log_text):
    cold = start(tmp_path)
    cache_dir = Path(cold["cache_dir"])
    entries = json.loads((cache_dir / "index.json").read_text())["entries"]
    last = cache_dir / entries[f"piece_{NUM_CAPTURABLE - 1}/general"]["artifact"]
    last.write_text(last.read_text() + "\n# damaged\n")
    damaged = start(tmp_path)
    text = log_text()
    assert f"the artifact of piece_{NUM_CAPTURABLE - 1}/general in {cache_dir}" in text
    assert "is missing or fails its checksum" in text
    counters = damaged["counters"]
    assert counters["num_dynamo_traces"] == 1
    assert counters["num_eager_compiles"] == 1  # the last structure only
    assert counters["num_compiled_artifacts_loaded"] == NUM_DISTINCT - 1
    assert counters["num_compiled_artifacts_saved"] == 1
    assert_same_outputs(damaged, cold)
    repaired = start(tmp_path)
    assert repaired["counters"]["num_traced_graphs_loaded"] == 1
    assert repaired["counters"]["num_eager_compiles"] == 0
    assert_same_outputs(repaired, cold)


def test_an_intact_artifact_that_does_not_load_is_named_and_the_start_traces(
    tmp_path, log_text, monkeypatch
):
    cold = start(tmp_path)

    def refuse(self, path, graph):
        raise ValueError("unreadable")

    monkeypatch.setattr(SavingEagerAdaptor, "load_artifact", refuse)
    again = start(tmp_path)
    text = log_text()
    assert "unusable (the artifact of piece_0/general does not load)" in text
    assert again["counters"]["num_dynamo_traces"] == 1
    assert_same_outputs(again, cold)


def test_an_artifact_that_fails_to_load_after_others_loaded_builds_each_piece_once(
    tmp_path, log_text, monkeypatch
):
    """Loading stops at the first artifact that does not load, before any piece is built, so the
    trace that follows builds every piece once, as a cold start does."""
    cold = start(tmp_path)
    load = SavingEagerAdaptor.load_artifact
    loads: list[str] = []

    def refuse_the_second(self, path, graph):
        loads.append(path)
        if len(loads) == 2:
            raise ValueError("unreadable")
        return load(self, path, graph)

    monkeypatch.setattr(SavingEagerAdaptor, "load_artifact", refuse_the_second)
    again = start(tmp_path)
    assert "unusable (the artifact of piece_1/general does not load)" in log_text()
    assert again["counters"]["num_dynamo_traces"] == 1
    assert again["counters"]["num_backend_compilations"] == NUM_CAPTURABLE
    assert cold["counters"]["num_backend_compilations"] == NUM_CAPTURABLE
    assert_same_outputs(again, cold)


def graphs_config(root: Path) -> EngineConfig:
    compilation = CompilationConfig(
        backend="eager",
        splitting_ops=[SILLY_OP],
        cudagraph_mode=CUDAGraphMode.PIECEWISE,
        cudagraph_capture_sizes=[1, 2, 4],
        compile_sizes=[2],
        cache_dir=str(root),
    )
    return EngineConfig(
        scheduler_config=SchedulerConfig(max_num_seqs=4), compilation_config=compilation
    )


def test_a_warm_start_with_piecewise_graphs_rebuilds_what_the_traced_start_built(
    tmp_path, log_text, graph_platform, caplog
):
    config = graphs_config(tmp_path)
    inputs = [torch.randn(n, 8, generator=torch.Generator().manual_seed(n)) for n in (4, 2)]
    cold_model = build(config, NUM_LAYERS)
    cold_outputs = [run(cold_model, config, x).clone() for x in inputs]
    (cold,) = piecewise_backends(cold_model)
    warm_config = graphs_config(tmp_path)
    warm_model = build(warm_config, NUM_LAYERS)
    caplog.set_level(logging.DEBUG, logger="pieceworks.core.piecewise_backend")
    with compilation_counter.expect(
        num_traced_graphs_loaded=1,
        num_compiled_artifacts_loaded=NUM_DISTINCT,  # the dynamic shape, the twins loading one
        num_eager_compiles=0,
    ):
        assert torch.equal(run(warm_model, warm_config, inputs[0]), cold_outputs[0])
    with compilation_counter.expect(
        num_compiled_artifacts_loaded=NUM_DISTINCT,  # size 2's, when size 2 first runs
        num_eager_compiles=0,
    ):
        assert torch.equal(run(warm_model, warm_config, inputs[1]), cold_outputs[1])
    static = {r.getMessage() for r in caplog.records if r.message.startswith("compiling piece")}
    assert static == {
        f"compiling piece {i}/{NUM_CAPTURABLE} for static size 2" for i in (1, 2, 3, 4)
    }
    (warm,) = piecewise_backends(warm_model)
    assert warm.split_gm is not None and warm.split_gm.code == cold.split_gm.code
    assert warm.piece_records == cold.piece_records
    assert warm.dynamic_input_indices == cold.dynamic_input_indices
    assert len(cold.dynamic_input_indices) == 1  # x: dim 0 is the token count
    options = [wrapper.options for wrapper in warm.static_graph_wrappers]
    assert len(options) == NUM_CAPTURABLE
    assert options == [wrapper.options for wrapper in cold.static_graph_wrappers]


def test_the_cache_directory_holds_its_key_factors_and_is_named_in_the_log(
    tmp_path, log_text, caplog
):
    cold = start(tmp_path)
    cache_dir = Path(cold["cache_dir"])
    factors = json.loads((cache_dir / "cache_key_factors.json").read_text())
    assert factors["compiler"] == {"name": "eager-with-artifacts"}
    messages = [record.getMessage() for record in caplog.records]
    assert f"compile cache: {cache_dir}" in messages
    first = (
        f"no other compile cache of model under {tmp_path}/torch_compile_cache (a first compile)"
    )
    assert f"compile cache miss (compiling every piece): {first}" in messages
    other = run_toy(str(tmp_path), NUM_LAYERS, backend="eager", max_model_len=4096)
    misses = [
        m for m in (r.getMessage() for r in caplog.records) if m.startswith("compile cache miss")
    ]
    assert misses[-1] == (
        f"compile cache miss (compiling every piece): the nearest cache, {cache_dir}, differs in "
        "1 factor(s): config.max_model_len: 2048 -> 4096"
    )
    assert other["cache_dir"] != cold["cache_dir"]


def test_a_cache_that_cannot_be_opened_is_named_and_a_stored_graph_traces(
    tmp_path, log_text, monkeypatch, caplog
):
    cold = start(tmp_path)

    def unwritable(directory, factors):
        raise OSError("read-only file system")

    monkeypatch.setattr(backend_module, "CompileCache", unwritable)
    caplog.set_level(logging.DEBUG, logger="pieceworks.core.backend")
    again = start(tmp_path)
    text = log_text()
    directory = cold["cache_dir"]
    assert (
        f"compile cache off: cannot write {directory} (read-only file system); set "
        "PIECEWORKS_CACHE_ROOT or CompilationConfig.cache_dir to a writable directory"
    ) in text
    assert f"unusable (the compile cache is not used (cannot write {directory})); tracing" in text
    messages = {record.getMessage() for record in caplog.records}
    assert f"compile cache not used (cannot write {directory})" in messages  # debug, each start
    counters = again["counters"]
    assert (counters["num_dynamo_traces"], counters["num_traced_graphs_loaded"]) == (1, 0)
    assert counters["num_eager_compiles"] == NUM_DISTINCT  # compiled, nothing loaded or saved
    assert (
        counters["num_compiled_artifacts_loaded"] == counters["num_compiled_artifacts_saved"] == 0
    )
    assert_same_outputs(again, cold)


def test_a_torch_that_does_not_report_the_traced_files_leaves_the_cache_off(
    tmp_path, log_text, monkeypatch, caplog
):
    monkeypatch.setattr(backend_module, "traced_source_files", lambda forward_code: None)
    caplog.set_level(logging.DEBUG, logger="pieceworks.core.backend")
    result = start(tmp_path)
    messages = {record.getMessage() for record in caplog.records}
    reason = "not used (Dynamo did not report the files it traced)"
    assert f"compile cache {reason}" in messages
    assert f"traced graph not stored ({reason}): every start of this model traces" in messages
    assert result["cache_dir"] is None
    assert result["counters"]["num_compiled_artifacts_saved"] == 0


def test_the_variable_that_disables_the_cache_is_named(tmp_path, log_text, monkeypatch, caplog):
    monkeypatch.setenv("PIECEWORKS_DISABLE_COMPILE_CACHE", "1")
    caplog.set_level(logging.DEBUG, logger="pieceworks.core.backend")
    result = start(tmp_path)
    messages = {record.getMessage() for record in caplog.records}
    assert "compile cache disabled (PIECEWORKS_DISABLE_COMPILE_CACHE=1)" in messages
    assert result["counters"]["num_compiled_artifacts_saved"] == 0


class FailingSaveAdaptor(SavingEagerAdaptor):
    """Its artifacts cannot be written (a full disk)."""

    def save_artifact(self, compiled: Any, path: str) -> None:
        raise OSError("no space left on device")


def test_an_artifact_that_cannot_be_saved_is_named_and_the_model_still_runs(
    tmp_path, log_text, monkeypatch
):
    reference = start(tmp_path / "reference")
    monkeypatch.setattr(backend_module, "make_compiler", lambda *_: FailingSaveAdaptor())
    unsaved = start(tmp_path / "unsaved")
    warning = (
        "compile cache: could not save piece_0/general (OSError('no space left on device')); "
        "it will be compiled again next run"
    )
    assert any(line.endswith(f" {warning}") for line in log_text().splitlines())
    assert unsaved["counters"]["num_compiled_artifacts_saved"] == 0
    assert_same_outputs(unsaved, reference)
