"""The run report: the compile-cache line (hit, miss, partial hit, disabled, not used), a mode
table whose cells stay apart when a value is wider than its column, failed rows that show their
error, a bar plot for one or several batch sizes, and the performance table of
``docs/performance.md`` (each configuration once, from the newest run that measured it, with the
peers of that run).

Run: pytest tests/benchmarks/test_report.py
"""

from __future__ import annotations

import pytest

from pieceworks.benchmarks.report import (
    MODE_TABLE_COLUMNS,
    compile_cache_status,
    format_compile_cache,
    format_floor_note,
    format_mode_table,
    format_performance_table,
    format_speedups,
    plot_latency,
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
    warm = result(3, 0, 0)
    warm["counters"]["num_traced_graphs_loaded"] = 1
    assert (
        compile_cache_status(warm)
        == "hit (3 artifacts loaded); traced graph loaded (no Dynamo trace)"
    )


def test_format_compile_cache_names_the_directory_and_compile_time():
    text = format_compile_cache([result(3, 0, 0)])
    assert text == (
        "compiled: compile cache: hit (3 artifacts loaded); compile 3.3 s\n"
        "    /c/torch_compile_cache/h/rank_0/model"
    )


def row(mode="eager", batch_size=8, median=123456.78, ratio=12199.94):
    counters = dict.fromkeys(
        ["num_inductor_compiles", "num_eager_compiles", "num_piecewise_graphs_seen",
         "num_piecewise_capturable_graphs_seen", "num_compiled_artifacts_loaded",
         "num_cudagraph_captured"], 3)  # fmt: skip
    return {"mode": mode, "status": "ok", "level": 0, "graph_mode": "NONE", "counters": counters,
            "graph_memory_gib": 0.0, "compile_s": None, "capture_s": 0.0,
            "latency_s": {"median": 2.446},
            "decode_step_ms": {"min": median * 0.9, "median": median, "max": median * 1.2},
            "device_busy_ms": None, "device_idle_share": None, "ratio_to_floor": ratio,
            "floor_ms": median / ratio, "batch_size": batch_size}  # fmt: skip


def test_mode_table_cells_stay_apart_when_a_value_overflows_its_column():
    header, rule, line = format_mode_table([row()]).splitlines()
    # A CPU run against a GPU-sized floor: both numbers wider than their columns (8 and 7)
    cells = line.split()
    assert cells[3] == "123456.78" and cells[6] == "12199.94"
    assert len(cells) == len(MODE_TABLE_COLUMNS)  # every cell apart, none empty
    assert cells[7:9] == ["n/a", "n/a"]  # device-busy and idle share not measured
    assert cells[10] == "-"  # no compile for eager
    assert header.split()[:4] == ["mode", "lvl", "graphs", "ms/step"] and set(rule) == {"-"}


def test_run_report_leaves_out_ratios_to_a_floor_too_small_to_mean_anything():
    tiny = row(median=5.0, ratio=25000.0)  # a 0.2 us floor: launches and host work rule
    large = row("compiled", median=5.0, ratio=2.5)  # a 2 ms floor
    assert format_mode_table([tiny]).splitlines()[2].split()[6] == "25000.00"  # bench: all
    lines = format_mode_table([tiny, large], only_meaningful_floors=True).splitlines()[2:]
    assert [line.split()[6] for line in lines] == ["-", "2.50"]
    assert "floor is 0.2 us per decode step" in format_floor_note([tiny, large])
    assert format_floor_note([large]) == ""


def test_speedups_against_eager():
    rows = [row(median=6.0), row("compiled", median=4.0), row("piecewise", median=8.0)]
    assert format_speedups(rows) == (
        "decode step vs eager (6.00 ms): compiled 1.50x, piecewise 0.75x (above 1x: faster)"
    )
    assert format_speedups(rows[1:]) == "" and format_speedups(rows[:1]) == ""


def test_a_failed_row_shows_its_error():
    failed = {"mode": "full", "status": "failed", "error": "RuntimeError: no memory"}
    lines = format_mode_table([row(), failed]).splitlines()
    assert lines[-1].split() == ["full", "failed:", "RuntimeError:", "no", "memory"]


@pytest.mark.parametrize("batch_sizes", [[8], [1, 8, 64]])
def test_plot_writes_bars_with_the_floor(tmp_path, batch_sizes):
    pytest.importorskip("matplotlib")
    results = [
        row(mode, b, median=1.0 + i + b / 10, ratio=1.5)
        for b in batch_sizes
        for i, mode in enumerate(["eager", "full_and_piecewise", "gpt_fast"])
    ]
    results.append({"mode": "static_compiled", "status": "failed", "batch_size": 8})
    path = tmp_path / "plot.png"
    assert plot_latency(path, results, "llama-tiny")
    assert path.stat().st_size > 1000


def bench_payload(date: str, commit: str, step_ms: float, batch_sizes=(1, 64)) -> dict:
    """A ``bench latency`` JSON: FULL_AND_PIECEWISE at ``step_ms`` x batch, gpt_fast twice that."""

    def row(mode: str, graph_mode: str, batch: int, ms: float) -> dict:
        steps = {"median": ms, "min": ms - 0.1, "max": ms + 1.0}
        return {
            "mode": mode,
            "graph_mode": graph_mode,
            "batch_size": batch,
            "decode_step_ms": steps,
        }

    results = []
    for batch in batch_sizes:
        ours = row("full_and_piecewise", "FULL_AND_PIECEWISE", batch, step_ms * batch)
        ours.update(level=3, ratio_to_floor=1.2, device_busy_ms=step_ms, device_idle_share=0.01)
        results += [ours, row("gpt_fast", "baseline", batch, 2 * step_ms * batch)]
    sizes = ",".join(map(str, batch_sizes))
    return {
        "model": "llama-3.1-8b", "dtype": "bfloat16", "date": date, "commit": commit,
        "device": "NVIDIA H200", "versions": {"torch": "2.11.0"}, "results": results,
        "command": f"pieceworks bench latency --batch-size {sizes}",
    }  # fmt: skip


def test_performance_table_keeps_the_newest_run_of_each_configuration():
    older = bench_payload("2026-12-02 07:36 UTC", "aaaa", 4.0)
    newer = bench_payload("2026-12-03 14:30 UTC", "bbbb", 0.1, batch_sizes=(64,))
    rows = format_performance_table([newer, older]).splitlines()[2:]
    assert len(rows) == 2  # batch 64 from the newer run only, batch 1 from the older
    cells = [row.split(" | ") for row in rows]
    assert [(c[2], c[8]) for c in cells] == [("64", "bbbb"), ("1", "aaaa")]
    assert "6.400 (6.300-7.400)" in rows[0] and "gpt_fast 12.80" in rows[0]
    assert "4.000 (3.900-5.000)" in rows[1] and "gpt_fast 8.00" in rows[1]
    assert rows[0].endswith("`pieceworks bench latency --batch-size 64` |")


def test_several_decode_steps_per_round_trip_make_rows_of_their_own():
    one = bench_payload("2026-12-02 07:36 UTC", "aaaa", 4.0, batch_sizes=(8,))
    eight = bench_payload("2026-12-03 14:30 UTC", "bbbb", 3.0, batch_sizes=(8,))
    eight["results"][0]["num_scheduler_steps"] = 8
    rows = format_performance_table([one, eight]).splitlines()[2:]
    modes = [row.split(" | ")[3] for row in rows]
    assert modes == [
        "full_and_piecewise (level 3, FULL_AND_PIECEWISE)",
        "full_and_piecewise (level 3, FULL_AND_PIECEWISE), 8 decode steps per round trip",
    ]
