"""``bench startup``: cold and warm runs, each in a fresh process, report every start-up phase.

Runs the CLI on llama-tiny at level 3 with the eager backend (Dynamo traces and the graph is split,
nothing is compiled or captured on the CPU), so the trace and backend phases are real and short.
Proves: two rows (cold, warm) whose phases are all present, non-negative and add up to the total;
the cold run traces once and the warm one loads the stored graph instead (its trace phase 0, its
graph-load phase and counter set); the JSON and the table written; a run whose torch modules had
no compiled bytecode is named under the table.
Run: pytest tests/benchmarks/test_startup.py
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pieceworks.benchmarks.startup import COUNTERS, PHASES
from pieceworks.entrypoints.cli import main


def test_bench_startup_reports_each_phase_cold_and_warm(tmp_path, capsys):
    out = tmp_path / "startup.json"
    status = main(
        ["bench", "startup", "--model", "llama-tiny", "--dtype", "float32", "--max-num-seqs", "4",
         "--compilation-config", '{"level": 3, "backend": "eager"}', "--output-json", str(out)]
    )  # fmt: skip
    assert status == 0
    table = capsys.readouterr().out
    assert "config | weight_load | dynamo_trace | graph_load | compile_or_load" in table
    assert "| loads | captures | triton" in table
    payload = json.loads(out.read_text())
    assert {"device", "versions", "commit", "date"} <= payload.keys()
    rows = payload["results"]
    assert [row["run"] for row in rows] == ["cold", "warm"]
    for row in rows:
        assert row["status"] == "ok"
        assert all(row[phase] >= 0 for phase in PHASES)
        for phase in (
            "config_s",
            "weight_load_s",
            "compile_or_load_s",
            "kv_cache_s",
            "first_step_s",
        ):
            assert row[phase] > 0, phase
        assert sum(row[phase] for phase in PHASES) == pytest.approx(row["total_s"], abs=1e-6)
        assert row["process_s"] > row["total_s"]  # the process also imported torch
        assert row["counters"]["num_inductor_compiles"] == 0  # the eager backend
        assert row["triton_cache_entries_added"] == 0  # no Triton kernel runs on the CPU
        assert isinstance(row["python_bytecode"], bool)
    cold, warm = rows
    assert cold["counters"]["num_dynamo_traces"] == 1
    assert cold["counters"]["num_traced_graphs_loaded"] == 0
    assert cold["dynamo_trace_s"] > 0 and cold["graph_load_s"] == 0
    assert warm["counters"]["num_dynamo_traces"] == 0  # the stored graph, not a trace
    assert warm["counters"]["num_traced_graphs_loaded"] == 1
    assert warm["dynamo_trace_s"] == 0 and warm["graph_load_s"] > 0


def test_each_phase_comes_from_what_the_engine_recorded(monkeypatch):
    from types import SimpleNamespace

    from pieceworks.benchmarks import startup
    from pieceworks.core import trace_once

    compilers = [
        SimpleNamespace(trace_seconds=0.5, graph_load_seconds=0.0, compile_seconds=2.0),
        SimpleNamespace(trace_seconds=0.25, graph_load_seconds=0.125, compile_seconds=1.0),
    ]
    monkeypatch.setattr(trace_once, "trace_once_compilers", lambda model: compilers)
    runner = SimpleNamespace(
        model=None,
        load_seconds=3.0,
        profiler=SimpleNamespace(
            compile_seconds=5.0, kernel_compile_seconds=0.25, kv_cache_seconds=0.75
        ),
        graphs=SimpleNamespace(warmup_seconds=1.5, capture_seconds=0.375),
    )
    engine = SimpleNamespace(runner=runner)
    llm = SimpleNamespace(engine=engine, config_seconds=0.625, tokenizer_seconds=0.0625)
    assert startup.engine_phases(llm, engine_seconds=20.0) == {
        "config_s": 0.625,
        "weight_load_s": 3.0,
        "dynamo_trace_s": 0.75,
        "graph_load_s": 0.125,
        "compile_or_load_s": 3.0,
        "kernel_compile_s": 0.25,
        "profile_run_s": 5.0 - 0.75 - 0.125 - 3.0,  # the first forward less what it traced,
        "kv_cache_s": 0.75,  # loaded and compiled
        "kernel_warmup_s": 1.5,
        "capture_s": 0.375,
        "tokenizer_s": 0.0625,
        "other_s": 20.0 - (0.625 + 3.0 + 5.0 + 0.25 + 0.75 + 1.5 + 0.375 + 0.0625),
    }


def test_triton_cache_entries_count_one_per_compiled_kernel(tmp_path):
    from pieceworks.benchmarks.startup import triton_cache_entries

    assert triton_cache_entries(tmp_path / "absent") == 0  # before Triton made its directory
    for key in ("KEYA", "KEYB"):
        (tmp_path / key).mkdir()
        (tmp_path / key / "_gemv_kernel.cubin").write_bytes(b"")
    (tmp_path / "lock").write_text("")  # a file, not an entry
    assert triton_cache_entries(tmp_path) == 2


def test_a_run_without_torch_bytecode_is_named_under_the_table(tmp_path, monkeypatch):
    import importlib.util
    import os
    import sys

    import torch

    from pieceworks.benchmarks.startup import format_startup_table, torch_bytecode_cached

    monkeypatch.setattr(sys, "pycache_prefix", str(tmp_path))  # where imports look for .pyc
    assert not torch_bytecode_cached()
    source = os.path.join(os.path.dirname(torch.__file__), "_inductor", "compile_fx.py")
    compiled = Path(importlib.util.cache_from_source(source))
    assert compiled.is_relative_to(tmp_path)
    compiled.parent.mkdir(parents=True)
    compiled.write_bytes(b"")
    assert torch_bytecode_cached()

    row = {name: 1.0 for name in PHASES} | {"engine_s": 1.0, "total_s": 1.0, "status": "ok"}
    row["counters"] = dict.fromkeys(COUNTERS, 0)
    rows = [row | {"run": "cold", "python_bytecode": True}]
    assert "warning" not in format_startup_table(rows)
    rows.append(row | {"run": "warm", "python_bytecode": False})
    warning = format_startup_table(rows).splitlines()[-1]
    assert warning.startswith("warning: the warm run found no compiled bytecode")
    assert "compileall" in warning
