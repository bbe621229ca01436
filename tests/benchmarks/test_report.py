"""The run report: the compile-cache line (hit, miss, partial hit, disabled, not used), and a
mode table whose cells stay apart when a value is wider than its column.

Run: pytest tests/engine/test_report.py
"""

from __future__ import annotations

from pieceworks.benchmarks.report import (
    MODE_TABLE_COLUMNS,
    compile_cache_status,
    format_compile_cache,
    format_mode_table,
)


def result(loaded: int, compiled: int, saved: int, dirs=("/c/torch_compile_cache/h/rank_0/model",)):
    counters = {
        "num_compiled_artifacts_loaded": loaded,
        "num_inductor_compiles": compiled,
        "num_compiled_artifacts_saved": saved,
    }
    cache = {"dirs": list(dirs), "off_reason": None if dirs else "disabled (X=1)"}
    return {"mode": "compiled", "compile_s": 3.31, "counters": counters, "compile_cache": cache}


def test_compile_cache_status_words():
    assert compile_cache_status(result(3, 0, 0)) == "hit (3 artifacts loaded)"
    assert compile_cache_status(result(0, 3, 3)) == "miss (3 compiled, 3 artifacts saved)"
    assert compile_cache_status(result(2, 1, 1)).startswith("partial hit (2 artifacts loaded")
    assert compile_cache_status(result(0, 3, 0, dirs=())) == "disabled (X=1)"


def test_format_compile_cache_names_the_directory_and_compile_time():
    text = format_compile_cache([result(3, 0, 0)])
    assert text == (
        "compiled: compile cache: hit (3 artifacts loaded); compile 3.3 s\n"
        "    /c/torch_compile_cache/h/rank_0/model"
    )


def test_mode_table_cells_stay_apart_when_a_value_overflows_its_column():
    counters = dict.fromkeys(
        ["num_inductor_compiles", "num_eager_compiles", "num_piecewise_graphs_seen",
         "num_piecewise_capturable_graphs_seen", "num_compiled_artifacts_loaded",
         "num_cudagraph_captured"], 3)  # fmt: skip
    row = {"mode": "eager", "graph_mode": "NONE", "counters": counters, "graph_memory_gib": 0.0,
           "compile_s": 1.1, "capture_s": 0.0, "latency_s": {"median": 2.446},
           "decode_step_ms": {"median": 123456.78}, "ratio_to_floor": 12199.94}  # fmt: skip
    header, rule, line = format_mode_table([row]).splitlines()
    # A CPU run against a GPU-sized floor: both numbers wider than their columns (8 and 7)
    assert line.split()[-2:] == ["123456.78", "12199.94"]
    assert len(line.split()) == len(MODE_TABLE_COLUMNS)
    assert header.split()[-3:] == ["ms/step", "x", "floor"] and set(rule) == {"-"}
