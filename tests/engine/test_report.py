"""The run report's compile-cache line: hit, miss, partial hit, disabled, not used.

Run: pytest tests/engine/test_report.py
"""

from __future__ import annotations

from pieceworks.engine.report import compile_cache_status, format_compile_cache


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
