"""The traced-graph cache (SPEC §3 compile cache, §6 warm start): a warm start traces nothing.

Proves, in fresh processes (``compile_cache_worker.py``, eager backend, a 2-layer toy of 3
capturable pieces): the second start runs no Dynamo trace (``num_dynamo_traces`` 0, no graph
reaches the backend) and computes the same outputs; an edited traced source file, another torch
or Triton version and another config each miss, with the reason logged; a damaged stored graph is
reported with a warning, traced again and stored anew. In process: a second start of the toy
loads the graph the first stored (the same counts and outputs as in a fresh process), another
config misses with the reason, a graph traced from another version of a traced file is traced
again naming the file, and a damaged graph is traced again with the warning; a graph file that
passes its checksum but does not unpickle is damage too; the arguments are described with their
dynamic dims starred, and another dtype or static dim of the first call's arguments is another
stored graph; the graph that is pickled keeps each constant and submodule its nodes read; the
backend keeps the first call's inputs and outputs, and only those, until released; and the
replay record (``GraphCall``) sources every input and output or refuses. Inductor artifacts on a
warm start: ``tests/core/warm_start/test_warm_start.py``. About 80 s on 2 CPU cores.
Run: pytest tests/core/warm_start/test_traced_graph_cache.py
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pieceworks.core.backend import FirstCallRecorder
from pieceworks.core.graph_call import GraphCall, UnsupportedGraphCall
from pieceworks.core.warm_start.rebuild import traced_graph_store
from pieceworks.core.warm_start.traced_graph_store import (
    MANIFEST_FILE,
    TracedGraphDamaged,
    TracedGraphStore,
    describe_arguments,
    portable_graph_module,
)
from tests.core.cache.compile_cache_worker import assert_same_outputs, run_toy, toy_config
from tests.core.toy_model import ToyModel

NUM_LAYERS = 2
NUM_CAPTURABLE = NUM_LAYERS + 1  # the pieces between the silly attention ops
REPO_ROOT = Path(__file__).resolve().parents[3]
IGNORED = shutil.ignore_patterns("__pycache__", "*.pyc")


def run_worker(
    cache_root: Path, out: Path, source_root: Path = REPO_ROOT, *extra: str
) -> tuple[dict, str]:
    """The eager toy in a fresh process with the cache on: (its result, its log)."""
    environment = {k: v for k, v in os.environ.items() if k != "PIECEWORKS_DISABLE_COMPILE_CACHE"}
    environment.update(PYTHONPATH=str(source_root), PIECEWORKS_LOGGING_LEVEL="INFO")
    command = [sys.executable, "-m", "tests.core.cache.compile_cache_worker", "--backend", "eager"]
    command += ["--cache-root", str(cache_root), "--out", str(out)]
    command += ["--num-layers", str(NUM_LAYERS), *extra]
    done = subprocess.run(
        command, cwd=source_root, env=environment, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    return torch.load(out), done.stderr


@pytest.fixture(scope="module")
def cold(tmp_path_factory):
    """The toy traced cold in a fresh process: (cache root, its result)."""
    root = tmp_path_factory.mktemp("traced_root")
    result, _ = run_worker(root, root / "cold.pt")
    return root, result


def copy_root(cold, tmp_path: Path) -> Path:
    shutil.copytree(cold[0], tmp_path / "root")
    return tmp_path / "root"


def stored_graph_dir(root: Path) -> Path:
    (directory,) = (root / "torch_compile_cache" / "traced_graphs").glob("*/rank_0/model")
    return directory


def assert_traced(result: dict) -> None:
    assert result["counters"]["num_dynamo_traces"] == 1
    assert result["counters"]["num_traced_graphs_loaded"] == 0


def test_a_cold_start_traces_once_and_stores_the_graph(cold):
    root, result = cold
    counters = result["counters"]
    assert counters["num_dynamo_traces"] == 1
    assert counters["num_traced_graphs_saved"] == 1
    directory = stored_graph_dir(root)
    manifest = json.loads((directory / MANIFEST_FILE).read_text())
    assert "tests/core/toy_model.py" in manifest["traced_files"]  # package-relative
    factors = json.loads((directory / "cache_key_factors.json").read_text())
    assert factors["versions"]["torch"] == str(torch.__version__)
    assert factors["module"]["class"] == "tests.core.toy_model.ToyModel"


def test_a_warm_start_in_a_fresh_process_runs_no_trace(cold, tmp_path):
    root, reference = cold
    result, log = run_worker(root, tmp_path / "warm.pt")
    counters = result["counters"]
    assert counters["num_dynamo_traces"] == 0
    assert counters["num_traced_graphs_loaded"] == 1
    assert counters["num_traced_graphs_saved"] == 0
    assert counters["num_graphs_seen"] == 0  # Dynamo handed the backend nothing
    assert counters["num_piecewise_graphs_seen"] == 0  # nothing was split
    assert counters["num_backend_compilations"] == NUM_CAPTURABLE  # the pieces, rebuilt
    assert counters["num_eager_compiles"] == NUM_CAPTURABLE  # each piece's graph, as is
    assert "traced graph loaded" in log
    assert_same_outputs(result, reference)


def test_an_edited_traced_source_file_misses_and_names_the_file(cold, tmp_path):
    source_root = tmp_path / "src"
    shutil.copytree(REPO_ROOT / "pieceworks", source_root / "pieceworks", ignore=IGNORED)
    shutil.copytree(REPO_ROOT / "tests", source_root / "tests", ignore=IGNORED)
    shutil.copy(REPO_ROOT / "pyproject.toml", source_root)  # its tool settings go with the tree
    root = tmp_path / "root"
    run_worker(root, tmp_path / "first.pt", source_root)
    toy_file = source_root / "tests" / "core" / "toy_model.py"
    toy_file.write_text(toy_file.read_text() + "\n# edited\n")
    result, log = run_worker(root, tmp_path / "edited.pt", source_root)
    assert (
        "the stored graph was traced from other sources "
        "(traced_files.tests/core/toy_model.py: changed); tracing" in log
    )
    assert_traced(result)
    assert_same_outputs(result, cold[1])


def test_another_torch_and_triton_version_miss_with_the_reason(cold, tmp_path):
    root = copy_root(cold, tmp_path)
    directory = stored_graph_dir(root)
    factors_file = directory / "cache_key_factors.json"
    factors = json.loads(factors_file.read_text())
    factors["versions"].update(torch="2.11.0", triton="3.5.0")
    factors_file.write_text(json.dumps(factors))
    directory.parents[1].rename(directory.parents[2] / "made_by_older_torch")
    result, log = run_worker(root, tmp_path / "warm.pt")
    assert "warm start: no stored traced graph (the nearest cache" in log
    assert "differs in 2 factor(s)" in log
    assert f"versions.torch: '2.11.0' -> '{torch.__version__}'" in log
    assert "versions.triton: '3.5.0' -> " in log
    assert_traced(result)


def test_another_config_misses_with_the_reason(cold, tmp_path):
    root = copy_root(cold, tmp_path)
    result, log = run_worker(root, tmp_path / "warm.pt", REPO_ROOT, "--max-model-len", "4096")
    assert "warm start: no stored traced graph (the nearest cache" in log
    assert "config.max_model_len: 2048 -> 4096" in log
    assert_traced(result)


def test_a_damaged_stored_graph_is_traced_again_with_a_warning(cold, tmp_path):
    root = copy_root(cold, tmp_path)
    (graph_file,) = stored_graph_dir(root).glob("graph-*.pkl")
    data = bytearray(graph_file.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same length, one flipped byte
    graph_file.write_bytes(bytes(data))
    result, log = run_worker(root, tmp_path / "damaged.pt")
    assert "WARNING" in log and "fails its checksum" in log
    assert "is unusable" in log and "tracing" in log
    assert_traced(result)
    assert result["counters"]["num_traced_graphs_saved"] == 1  # stored anew
    assert_same_outputs(result, cold[1])
    repaired, _ = run_worker(root, tmp_path / "repaired.pt")
    assert repaired["counters"]["num_dynamo_traces"] == 0


def test_a_graph_file_that_does_not_unpickle_is_damage(cold, tmp_path):
    root = copy_root(cold, tmp_path)
    directory = stored_graph_dir(root)
    manifest = json.loads((directory / MANIFEST_FILE).read_text())
    garbage = b"not a pickle"
    (directory / manifest["graph"]).write_bytes(garbage)
    manifest["graph_sha256"] = hashlib.sha256(garbage).hexdigest()
    store = TracedGraphStore(toy_config(str(root)), {}, "")
    store.directory = str(directory)
    with pytest.raises(TracedGraphDamaged, match="does not load"):
        store.load_graph(manifest)


def test_an_unreadable_manifest_is_damage(tmp_path):
    store = TracedGraphStore(toy_config(str(tmp_path)), {}, "")
    os.makedirs(store.directory)
    Path(store.manifest_path).write_text("{")
    with pytest.raises(TracedGraphDamaged, match="manifest.json is unreadable"):
        store.read_manifest()


def graph_call_of(model: torch.nn.Module, result) -> GraphCall:
    weight = model.layers[0].weight
    x = torch.ones(4, 8)
    return GraphCall.record(
        model,
        ["L['self']._modules['layers']._modules['0']._parameters['weight']", "L['x'].size()[0]",
         "L['x']"],
        [weight, 4, x],
        (result,),
        ((x,), {}),
        result,
    )  # fmt: skip


def test_graph_call_sources_each_input_and_rebuilds_the_result():
    model = ToyModel(config=toy_config("unused"), num_layers=1)
    output = torch.zeros(4, 8)
    call = GraphCall.from_json(json.loads(json.dumps(graph_call_of(model, output).to_json())))
    assert call.inputs == (("state", "layers.0.weight"), ("size", ("x", 0)), ("arg", "x"))
    assert call.output_leaves == (("output", 0),)
    seen = []
    bound = call.bind(model, lambda *inputs: seen.append(inputs) or (inputs[2] * inputs[1],))
    x = torch.ones(3, 8)
    assert torch.equal(bound(x), x * 3)
    assert seen[0][0] is model.layers[0].weight and seen[0][1] == 3 and seen[0][2] is x


def test_graph_call_refuses_what_it_cannot_replay():
    model = ToyModel(config=toy_config("unused"), num_layers=1)
    x = torch.ones(1)
    with pytest.raises(UnsupportedGraphCall, match="the forward returns a Tensor"):
        GraphCall.record(model, ["L['x']"], [x], (), ((x,), {}), torch.zeros(1))
    with pytest.raises(UnsupportedGraphCall, match="G\\['table'\\]"):
        GraphCall.record(model, ["G['table']"], [torch.ones(1)], (), ((torch.ones(1),), {}), 1)
    smaller = ToyModel(config=toy_config("unused"), num_layers=1)
    del smaller.layers[0]._parameters["weight"]
    with pytest.raises(UnsupportedGraphCall, match="no parameter or buffer layers.0.weight"):
        graph_call_of(model, torch.zeros(4, 8)).bind(smaller, lambda *inputs: inputs)


def test_a_second_start_in_the_same_process_loads_the_stored_graph(tmp_path, log_text):
    cold = run_toy(str(tmp_path), NUM_LAYERS, backend="eager")
    assert_traced(cold)
    assert cold["counters"]["num_traced_graphs_saved"] == 1
    warm = run_toy(str(tmp_path), NUM_LAYERS, backend="eager")
    counters = warm["counters"]
    assert (counters["num_dynamo_traces"], counters["num_traced_graphs_loaded"]) == (0, 1)
    assert (counters["num_traced_graphs_saved"], counters["num_graphs_seen"]) == (0, 0)
    assert counters["num_piecewise_graphs_seen"] == 0  # nothing was split
    assert counters["num_backend_compilations"] == NUM_CAPTURABLE  # the pieces, rebuilt
    assert counters["num_eager_compiles"] == NUM_CAPTURABLE
    loaded = f"warm start: traced graph loaded from {stored_graph_dir(tmp_path)} (no Dynamo trace)"
    assert loaded in log_text()
    assert warm["cache_dir"] == cold["cache_dir"]
    assert_same_outputs(warm, cold)


def test_another_config_in_the_same_process_misses_with_the_reason(tmp_path, log_text):
    cold = run_toy(str(tmp_path), NUM_LAYERS, backend="eager")
    other = run_toy(str(tmp_path), NUM_LAYERS, backend="eager", max_model_len=4096)
    assert "config.max_model_len: 2048 -> 4096" in log_text()
    assert_traced(other)
    assert other["cache_dir"] != cold["cache_dir"]
    assert_same_outputs(other, cold)


def test_a_damaged_graph_in_the_same_process_is_traced_again_with_a_warning(tmp_path, log_text):
    cold = run_toy(str(tmp_path), NUM_LAYERS, backend="eager")
    (graph_file,) = stored_graph_dir(tmp_path).glob("graph-*.pkl")
    graph_file.write_bytes(graph_file.read_bytes()[:-1] + b"x")  # same length, last byte
    damaged = run_toy(str(tmp_path), NUM_LAYERS, backend="eager")
    assert "fails its checksum" in log_text() and "is unusable" in log_text()
    assert_traced(damaged)
    assert damaged["counters"]["num_traced_graphs_saved"] == 1  # stored anew
    assert_same_outputs(damaged, cold)


def test_a_graph_traced_from_another_source_in_the_same_process_is_traced_again(tmp_path, log_text):
    cold = run_toy(str(tmp_path), NUM_LAYERS, backend="eager")
    manifest_path = stored_graph_dir(tmp_path) / MANIFEST_FILE
    manifest = json.loads(manifest_path.read_text())
    (toy_file,) = [name for name in manifest["traced_files"] if name.endswith("toy_model.py")]
    manifest["traced_files"][toy_file] = "0" * 64  # as if traced from another toy_model.py
    manifest_path.write_text(json.dumps(manifest))
    edited = run_toy(str(tmp_path), NUM_LAYERS, backend="eager")
    assert (
        "warm start: the stored graph was traced from other sources "
        f"(traced_files.{toy_file}: changed); tracing" in log_text()
    )
    assert_traced(edited)
    assert_same_outputs(edited, cold)


def test_the_stored_graph_is_keyed_by_the_first_call_s_arguments(tmp_path, monkeypatch):
    """Another dtype or a static dim of another size is another stored graph; another size of a
    dynamic dim is the same one (the toy's ``x`` is dynamic in dim 0)."""
    monkeypatch.delenv("PIECEWORKS_DISABLE_COMPILE_CACHE", raising=False)
    config = toy_config(str(tmp_path), backend="eager")
    model = ToyModel(config=config, num_layers=1)
    backend = model._pieceworks_compiler.piecewise_backend
    store = lambda x: traced_graph_store(backend, model, (x,), {})  # noqa: E731
    stored = store(torch.ones(4, 8))
    assert stored is not None
    assert stored.factors["call"]["arguments"] == {"x": "torch.float32 cpu (*, 8)"}
    assert store(torch.ones(6, 8)).directory == stored.directory
    assert store(torch.ones(4, 8, dtype=torch.float16)).directory != stored.directory
    assert store(torch.ones(4, 16)).directory != stored.directory


def test_a_portable_graph_keeps_the_constants_and_submodules_it_reads():
    """The copy that is pickled holds each attribute its nodes read (a constant, a submodule)
    and nothing else, and computes what the original does after a pickle round trip."""
    module = torch.nn.Module()
    module.register_buffer("table", torch.arange(3.0))
    module.register_buffer("unused", torch.ones(2))
    module.scale = torch.nn.Linear(3, 3)
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    added = graph.call_function(torch.add, (x, graph.get_attr("table")))
    graph.output(graph.call_module("scale", (added,)))
    original = torch.fx.GraphModule(module, graph)
    portable = pickle.loads(pickle.dumps(portable_graph_module(original)))
    assert torch.equal(portable.table, torch.arange(3.0)) and not hasattr(portable, "unused")
    x_value = torch.ones(2, 3)
    assert torch.equal(portable(x_value), original(x_value))


def test_the_arguments_are_described_with_their_dynamic_dims_starred():
    x, mask, table = torch.ones(4, 8), torch.ones(4, 3, dtype=torch.bool), torch.ones(2, 5)
    arguments = {"x": x, "mask": mask, "table": table, "eps": 1e-6, "name": "n" * 300}
    described = describe_arguments(arguments, {"x": 0, "mask": [0, 1]})
    assert list(described) == ["eps", "mask", "name", "table", "x"]  # sorted by name
    assert described["x"] == "torch.float32 cpu (*, 8)"
    assert described["mask"] == "torch.bool cpu (*, *)"
    assert described["table"] == "torch.float32 cpu (2, 5)"  # no dynamic dims: all static
    assert (described["eps"], described["name"]) == ("1e-06", repr("n" * 300)[:200])


def test_the_first_call_is_kept_until_released_and_later_calls_are_not():
    recorder = FirstCallRecorder(lambda *inputs: [x * 2 for x in inputs])
    assert (recorder.inputs, recorder.outputs, recorder.recording) == (None, None, True)
    first, second = torch.ones(2), torch.zeros(2)
    assert recorder(first)[0].tolist() == [2.0, 2.0]
    recorder(second)
    assert recorder.inputs == (first,) and recorder.outputs[0].tolist() == [2.0, 2.0]
    assert recorder.recording is False
    recorder.release()
    assert (recorder.inputs, recorder.outputs, recorder.recording) == (None, None, False)
    recorder(first)  # released: nothing is kept again
    assert (recorder.inputs, recorder.outputs) == (None, None)
