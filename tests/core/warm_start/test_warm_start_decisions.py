"""What ``save_traced_graph`` and ``load_traced_graph`` decide, and the line each logs.

On a small backend fake (the attributes the two functions read) and a real ``TracedGraphStore``
in a temporary root. Proves: a graph is not stored, with the reason logged in full, when the
cache key is unknown (the backend's reason or a default), when the forward changes Python state
(the first such instruction named) or when the compiled graph never ran; a store that fails is a
warning naming the directory, and the model goes on; a stored graph is counted and logged with
its directory; the first call's tensors are released in every case. A load logs, in full, that
no graph is stored (with the miss's reason), that a traced file is not imported, that the stored
graph does not fit the module, or that it is unusable (a damage's own message, any other error's
repr), and returns None so the caller traces; a load that fits is counted, logged with its
directory, records the load time and replays the stored call through the rebuilt forward. And
``side_effects`` lists the instructions of a code object that change Python state, in order.
Run: pytest tests/core/warm_start/test_warm_start_decisions.py
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from pieceworks.core.backend import FirstCallRecorder
from pieceworks.core.compiler_interface import EagerAdaptor
from pieceworks.core.counters import compilation_counter
from pieceworks.core.warm_start.rebuild import load_traced_graph, save_traced_graph, side_effects
from pieceworks.core.warm_start.traced_graph_store import TracedGraphDamaged, TracedGraphStore
from tests.core.cache.compile_cache_worker import toy_config

LOGGER = "pieceworks.core.warm_start.rebuild"


class Doubler(torch.nn.Module):
    def forward(self, x):
        return x * 2


def pure(self, x):
    return x * 2


def assigns(self, x):
    self.weight = x
    return x


def logged(caplog: pytest.LogCaptureFixture) -> list[tuple[int, str]]:
    """(level, message) of each warm-start record, each once (pytest may hand a record to its
    handler through both the pieceworks logger and the root)."""
    records = {id(r): r for r in caplog.records if r.name == LOGGER}.values()
    return [(record.levelno, record.getMessage()) for record in records]


@pytest.fixture
def caplog_info(caplog, monkeypatch):
    monkeypatch.setattr(logging.getLogger("pieceworks"), "propagate", True)
    caplog.set_level(logging.INFO, logger=LOGGER)
    return caplog


def ran_recorder(x: torch.Tensor) -> FirstCallRecorder:
    recorder = FirstCallRecorder(lambda value: (value * 2,))
    recorder(x)
    return recorder


def fake_backend(tmp_path, **overrides) -> SimpleNamespace:
    x = torch.ones(3)
    graph = torch.fx.symbolic_trace(Doubler())
    attributes = {
        "config": toy_config(str(tmp_path), backend="eager"),
        "compiler": EagerAdaptor(),
        "first_call": ran_recorder(x),
        "cache_key_factors": {"traced_files": {}},
        "split_gm": graph,
        "cache_off_reason": None,
        "input_sources": ["L['x']"],
        "piece_records": [{"index": 0}],
        "dynamic_input_indices": [0],
        "rebuild": lambda record, files: lambda value: (value * 2,),
        "graph_load_seconds": None,
    }
    return SimpleNamespace(**{**attributes, **overrides})


def store_in(tmp_path) -> TracedGraphStore:
    return TracedGraphStore(toy_config(str(tmp_path), backend="eager"), {"format": 1}, "")


def save(backend, store, code=pure.__code__) -> None:
    x = backend.first_call.inputs[0] if backend.first_call.inputs else torch.ones(3)
    result = backend.first_call.outputs[0] if backend.first_call.outputs else None
    save_traced_graph(store, backend, Doubler(), code, ((x,), {}), result)


@pytest.mark.parametrize(
    "overrides, reason",
    [
        ({"cache_key_factors": None, "cache_off_reason": "the compile cache is disabled"},
         "the compile cache is disabled"),
        ({"cache_key_factors": None}, "the cache key is unknown"),
        ({"split_gm": None}, "the cache key is unknown"),
        ({"first_call": FirstCallRecorder(lambda value: value)},
         "the compiled graph did not run on the first call"),
    ],
)  # fmt: skip
def test_a_graph_not_stored_logs_the_reason(tmp_path, caplog_info, overrides, reason):
    backend = fake_backend(tmp_path, **overrides)
    store = store_in(tmp_path)
    with compilation_counter.expect(num_traced_graphs_saved=0):
        save(backend, store)
    assert logged(caplog_info) == [
        (logging.INFO, f"traced graph not stored ({reason}): every start of this model traces")
    ]
    assert isinstance(store.read_manifest(), str)  # nothing stored
    assert backend.first_call.recording is False and backend.first_call.inputs is None


def test_a_forward_that_changes_python_state_is_not_stored(tmp_path, caplog_info):
    backend = fake_backend(tmp_path)
    save(backend, store_in(tmp_path), assigns.__code__)
    assert logged(caplog_info) == [
        (
            logging.INFO,
            "traced graph not stored (the forward changes Python state (STORE_ATTR weight)): "
            "every start of this model traces",
        )
    ]
    assert backend.first_call.inputs is None


def test_a_store_that_fails_is_a_warning_and_the_model_goes_on(tmp_path, caplog_info):
    backend = fake_backend(tmp_path)
    store = store_in(tmp_path)
    store.save = lambda record, files: (_ for _ in ()).throw(OSError("read-only"))
    with compilation_counter.expect(num_traced_graphs_saved=0):
        save(backend, store)
    assert logged(caplog_info) == [
        (logging.WARNING, f"traced graph not stored in {store.directory} (OSError('read-only'))")
    ]
    assert backend.first_call.inputs is None


def test_a_stored_graph_is_counted_logged_and_loads_back(tmp_path, caplog_info):
    backend = fake_backend(tmp_path)
    store = store_in(tmp_path)
    with compilation_counter.expect(num_traced_graphs_saved=1):
        save(backend, store)
    assert logged(caplog_info) == [
        (logging.INFO, f"traced graph stored for warm starts: {store.directory}")
    ]
    record = store.load_graph(store.read_manifest())
    assert record["pieces"] == [{"index": 0}] and record["dynamic_input_indices"] == [0]
    assert record["call"]["inputs"] == (("arg", "x"),)
    assert record["call"]["output_leaves"] == (("output", 0),)
    assert torch.equal(record["split_graph"](torch.ones(2)), torch.full((2,), 2.0))
    assert backend.first_call.inputs is None and backend.first_call.outputs is None


def stored(tmp_path) -> tuple[SimpleNamespace, TracedGraphStore]:
    backend, store = fake_backend(tmp_path), store_in(tmp_path)
    save(backend, store)
    return fake_backend(tmp_path), store


def test_a_load_that_fits_replays_the_call_through_the_rebuilt_forward(tmp_path, caplog_info):
    backend, store = stored(tmp_path)
    caplog_info.clear()
    with compilation_counter.expect(num_traced_graphs_loaded=1):
        forward = load_traced_graph(store, backend, Doubler())
    assert forward is not None
    assert torch.equal(forward(torch.ones(5)), torch.full((5,), 2.0))
    assert isinstance(backend.graph_load_seconds, float) and backend.graph_load_seconds >= 0
    assert logged(caplog_info) == [
        (logging.INFO, f"warm start: traced graph loaded from {store.directory} (no Dynamo trace)")
    ]


def test_no_stored_graph_is_logged_with_the_reason(tmp_path, caplog_info):
    store = store_in(tmp_path)
    with compilation_counter.expect(num_traced_graphs_loaded=0):
        assert load_traced_graph(store, fake_backend(tmp_path), Doubler()) is None
    assert logged(caplog_info) == [
        (logging.INFO, f"warm start: no stored traced graph ({store.read_manifest()}); tracing")
    ]


def test_a_traced_file_not_imported_here_is_logged(tmp_path, caplog_info):
    backend, store = fake_backend(tmp_path), store_in(tmp_path)
    store.save({"call": {}}, {"pieceworks/not_a_module.py": "0" * 64})
    assert load_traced_graph(store, backend, Doubler()) is None
    assert logged(caplog_info) == [
        (
            logging.INFO,
            "warm start: traced file pieceworks/not_a_module.py is not imported in this process; "
            "tracing",
        )
    ]


class Renamed(torch.nn.Module):
    def forward(self, y):
        return y * 2


def test_a_stored_graph_that_does_not_fit_the_module_is_logged(tmp_path, caplog_info):
    backend, store = stored(tmp_path)
    caplog_info.clear()
    with compilation_counter.expect(num_traced_graphs_loaded=0):
        assert load_traced_graph(store, backend, Renamed()) is None
    assert logged(caplog_info) == [
        (
            logging.INFO,
            "warm start: the stored graph does not fit this module (the forward's arguments "
            "differ from the traced ones); tracing",
        )
    ]
    assert backend.graph_load_seconds is None


@pytest.mark.parametrize(
    "error, detail",
    [
        (TracedGraphDamaged("piece 0's artifact is missing"), "piece 0's artifact is missing"),
        (KeyError("split_graph"), "KeyError('split_graph')"),
    ],
)
def test_an_unusable_stored_graph_is_a_warning(tmp_path, caplog_info, error, detail):
    backend, store = stored(tmp_path)
    backend.rebuild = lambda record, files: (_ for _ in ()).throw(error)
    caplog_info.clear()
    assert load_traced_graph(store, backend, Doubler()) is None
    assert logged(caplog_info) == [
        (
            logging.WARNING,
            f"warm start: the stored traced graph in {store.directory} is unusable ({detail}); "
            "tracing, and compiling what is damaged",
        )
    ]


def test_side_effects_lists_the_instructions_that_change_python_state():
    table: dict = {}

    def effects(self, x):
        global GLOBAL_VALUE
        self.weight = x
        table[0] = x
        GLOBAL_VALUE = x
        del self.bias
        return x

    assert side_effects(effects.__code__) == [
        "STORE_ATTR weight",
        "STORE_SUBSCR None",
        "STORE_GLOBAL GLOBAL_VALUE",
        "DELETE_ATTR bias",
    ]
    assert side_effects(pure.__code__) == []
