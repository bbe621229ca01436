"""``TracedGraphStore`` and the warm-start factors, on the files themselves, in process.

Proves: the factors of a stored graph's key, by name and value (the names that
``cache_key_factors.json`` and a miss's reason show), follow the module's class, state layout
and mode and the call's arguments and grad mode; the store's directory is laid out by factors
hash, rank and prefix under the cache root; a saved record is written as the factors file, a
graph file named by its checksum and a manifest naming it, and reads back whole; each reason not
to use a stored graph reads in full (none stored, the nearest other stored graph's differences,
an unreadable manifest, a graph file that is missing, fails its checksum, does not unpickle or
is no record; a traced file not imported here, or changed); the graph that is pickled holds the
registered submodule even where the instance shadows it.
Run: pytest tests/core/warm_start/test_traced_graph_store.py
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import platform
from pathlib import Path

import pytest
import torch
import triton

from pieceworks import envs
from pieceworks.core.compiler_interface import EagerAdaptor
from pieceworks.core.warm_start.traced_graph_store import (
    TRACED_GRAPH_VERSION,
    TracedGraphDamaged,
    TracedGraphStore,
    portable_graph_module,
    resolve_traced_files,
    state_layout_hash,
    warm_start_factors,
)
from pieceworks.utils import hash_factors
from tests.core.cache.compile_cache_worker import toy_config

ARGUMENTS = {"x": "torch.float32 cpu (*, 8)"}


def test_the_warm_start_factors_by_name(tmp_path):
    config = toy_config(str(tmp_path), backend="eager")
    module = torch.nn.Linear(8, 4)
    factors = warm_start_factors(config, EagerAdaptor(), module, ARGUMENTS)
    assert factors == {
        "format": TRACED_GRAPH_VERSION,
        "env": envs.compile_factors(),
        "config": config.compute_factors(),
        "compiler": {"name": "eager"},
        "versions": {
            "torch": str(torch.__version__),
            "torch_git": torch.version.git_version,
            "triton": triton.__version__,
            "python": platform.python_version(),
        },
        "module": {
            "class": "torch.nn.modules.linear.Linear",
            "state": state_layout_hash(module),
            "training": True,
        },
        "call": {"arguments": ARGUMENTS, "grad_enabled": True, "inference_mode": False},
    }
    assert json.loads(json.dumps(factors)) == factors  # JSON-ready
    module.eval()
    with torch.inference_mode():
        later = warm_start_factors(config, EagerAdaptor(), module, ARGUMENTS)
    assert later["module"]["training"] is False
    assert later["call"] == {"arguments": ARGUMENTS, "grad_enabled": False, "inference_mode": True}
    with torch.no_grad():
        no_grad = warm_start_factors(config, EagerAdaptor(), module, ARGUMENTS)
    assert no_grad["call"]["grad_enabled"] is False
    assert no_grad["call"]["inference_mode"] is False


def test_the_state_layout_hash_follows_names_dtypes_and_shapes_not_values():
    layout = state_layout_hash(torch.nn.Linear(8, 4))
    assert len(layout) == 16 and int(layout, 16) >= 0
    assert state_layout_hash(torch.nn.Linear(8, 4)) == layout  # other weights, same layout
    assert state_layout_hash(torch.nn.Linear(8, 4).half()) != layout
    assert state_layout_hash(torch.nn.Linear(8, 5)) != layout
    assert state_layout_hash(torch.nn.Linear(8, 4, bias=False)) != layout
    renamed = torch.nn.Module()
    renamed.register_parameter("w", torch.nn.Linear(8, 4).weight)
    renamed.register_parameter("b", torch.nn.Linear(8, 4).bias)
    assert state_layout_hash(renamed) != layout
    assert state_layout_hash(torch.nn.Linear(8, 4, device="meta")) != layout


def store_at(root: Path, factors: dict, prefix: str = "") -> TracedGraphStore:
    return TracedGraphStore(toy_config(str(root), backend="eager"), factors, prefix)


def test_the_store_lies_under_the_root_by_factors_rank_and_prefix(tmp_path, monkeypatch):
    factors = {"format": 1, "call": ARGUMENTS}
    base = tmp_path / "torch_compile_cache" / "traced_graphs" / hash_factors(factors) / "rank_0"
    assert store_at(tmp_path, factors).directory == str(base / "model")
    assert store_at(tmp_path, factors, "language_model").directory == str(base / "language_model")
    assert store_at(tmp_path, factors, "a/b").directory == str(base / "a_b")
    assert store_at(tmp_path, factors).manifest_path == str(base / "model" / "manifest.json")
    assert store_at(tmp_path, {"format": 2}).directory != str(base / "model")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    home = store_at(Path("~/cache"), factors).directory
    assert home.startswith(str(tmp_path / "home" / "cache" / "torch_compile_cache"))


def test_a_saved_record_reads_back_with_its_manifest_and_factors_file(tmp_path):
    factors = {"format": 1, "call": ARGUMENTS}
    store = store_at(tmp_path, factors)
    record = {"pieces": [1, 2], "call": {"arg_names": ["x"]}}
    store.save(record, {"pieceworks/models/llama.py": "ab" * 32})
    data = pickle.dumps({"version": TRACED_GRAPH_VERSION, **record})
    checksum = hashlib.sha256(data).hexdigest()
    directory = Path(store.directory)
    assert sorted(os.listdir(directory)) == [
        "cache_key_factors.json",
        f"graph-{checksum[:16]}.pkl",
        "manifest.json",
    ]
    assert json.loads((directory / "cache_key_factors.json").read_text()) == factors
    manifest = store.read_manifest()
    assert manifest == {
        "version": TRACED_GRAPH_VERSION,
        "traced_files": {"pieceworks/models/llama.py": "ab" * 32},
        "graph": f"graph-{checksum[:16]}.pkl",
        "graph_sha256": checksum,
    }
    assert store.load_graph(manifest) == {"version": TRACED_GRAPH_VERSION, **record}


def test_no_stored_graph_says_why(tmp_path):
    store = store_at(tmp_path, {"format": 1, "call": ARGUMENTS})
    root = tmp_path / "torch_compile_cache" / "traced_graphs"
    assert (
        store.read_manifest() == f"no other compile cache of model under {root} (a first compile)"
    )
    store_at(tmp_path, {"format": 1, "call": {"x": "torch.float16 cpu (*, 8)"}}).save({}, {})
    other = store_at(tmp_path, {"format": 1, "call": {"x": "torch.float16 cpu (*, 8)"}})
    assert store.read_manifest() == (
        f"the nearest cache, {other.directory}, differs in 1 factor(s): "
        "call.x: 'torch.float16 cpu (*, 8)' -> 'torch.float32 cpu (*, 8)'"
    )


@pytest.mark.parametrize(
    "manifest, reason",
    [
        ({"version": 2}, "not a version-1 manifest"),
        ({"version": 1, "graph": "g", "graph_sha256": "s"}, "'traced_files'"),
        ({"version": 1, "traced_files": {}, "graph_sha256": "s"}, "'graph'"),
        ({"version": 1, "traced_files": {}, "graph": "g"}, "'graph_sha256'"),
        ({"version": 1, "traced_files": [], "graph": "g", "graph_sha256": "s"}, None),
    ],
)
def test_an_unreadable_manifest_is_damage_named_in_full(tmp_path, manifest, reason):
    store = store_at(tmp_path, {"format": 1})
    os.makedirs(store.directory)
    Path(store.manifest_path).write_text(json.dumps(manifest))
    with pytest.raises(TracedGraphDamaged) as damaged:
        store.read_manifest()
    prefix = f"{store.manifest_path} is unreadable ("
    assert str(damaged.value).startswith(prefix)
    if reason is not None:
        assert str(damaged.value) == f"{prefix}{reason})"


def test_a_graph_file_that_cannot_be_used_is_damage_named_in_full(tmp_path):
    store = store_at(tmp_path, {"format": 1})
    store.save({"pieces": []}, {})
    manifest = store.read_manifest()
    path = os.path.join(store.directory, manifest["graph"])
    with pytest.raises(TracedGraphDamaged) as missing:
        store.load_graph({**manifest, "graph": "graph-gone.pkl"})
    gone = os.path.join(store.directory, "graph-gone.pkl")
    assert str(missing.value) == f"{gone} is missing or fails its checksum"
    with pytest.raises(TracedGraphDamaged) as checksum:
        store.load_graph({**manifest, "graph_sha256": "0" * 64})
    assert str(checksum.value) == f"{path} is missing or fails its checksum"
    for content, reason in (
        (pickle.dumps([1, 2]), f"{path} is not a version-1 graph"),
        (pickle.dumps({"version": 2}), f"{path} is not a version-1 graph"),
        (b"not a pickle", f"{path} does not load (UnpicklingError("),
    ):
        Path(path).write_bytes(content)
        with pytest.raises(TracedGraphDamaged) as damaged:
            store.load_graph({**manifest, "graph_sha256": hashlib.sha256(content).hexdigest()})
        assert str(damaged.value).startswith(reason)


def test_changed_traced_files_are_named():
    manifest = {"traced_files": {"a.py": "1", "b.py": "2"}}
    assert TracedGraphStore.changed_files(manifest, {"a.py": "1", "b.py": "2"}) is None
    assert TracedGraphStore.changed_files(manifest, {"a.py": "9", "c.py": "3"}) == (
        "traced_files.a.py: changed; traced_files.b.py: removed; traced_files.c.py: added"
    )


def test_traced_files_resolve_to_this_process_s_files_or_a_reason(tmp_path):
    import pieceworks.core.cache.artifact_key as imported

    real = os.path.realpath(imported.__file__)
    assert resolve_traced_files(["pieceworks/core/cache/artifact_key.py"]) == [real]
    outside = tmp_path / "helper.py"
    outside.write_text("")
    assert resolve_traced_files([str(outside), "pieceworks/core/cache/artifact_key.py"]) == [
        str(outside),
        real,
    ]
    missing = str(tmp_path / "gone.py")
    for path in ("pieceworks/not_a_module.py", missing):
        assert resolve_traced_files(["pieceworks/core/cache/artifact_key.py", path]) == (
            f"traced file {path} is not imported in this process"
        )


def test_a_relative_path_is_never_read_from_the_working_directory(tmp_path, monkeypatch):
    # A file of that name beside the process is not the module this process imported.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "never_imported.py").write_text("x = 1\n")
    assert resolve_traced_files(["pkg/never_imported.py"]) == (
        "traced file pkg/never_imported.py is not imported in this process"
    )


def test_the_portable_graph_holds_the_registered_piece_not_the_instance_s_shadow():
    inner_graph = torch.fx.Graph()
    y = inner_graph.placeholder("y")
    inner_graph.output(inner_graph.call_function(torch.mul, (y, 3)))
    inner = torch.fx.GraphModule(torch.nn.Module(), inner_graph)
    outer_graph = torch.fx.Graph()
    x = outer_graph.placeholder("x")
    outer_graph.output(outer_graph.call_module("submod_0", (x,)))
    outer = torch.fx.GraphModule({"submod_0": inner}, outer_graph)
    outer.__dict__["submod_0"] = lambda value: value  # the backend's compiled piece, unpicklable
    portable = pickle.loads(pickle.dumps(portable_graph_module(outer)))
    assert isinstance(portable.submod_0, torch.fx.GraphModule)
    assert torch.equal(portable(torch.ones(2)), torch.full((2,), 3.0))
