"""Text and plots of run and benchmark results (what `pieceworks run` and `bench` print)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pieceworks.logger import init_logger

logger = init_logger(__name__)


# (title, width): text columns are left-aligned, the others right-aligned
MODE_TABLE_COLUMNS = [
    ("mode", -20), ("graphs", -20), ("pieces", 6), ("capt.", 5), ("compiles", 8), ("cache", 5),
    ("graphs#", 7), ("graph GiB", 9), ("compile s", 9), ("capture s", 9), ("latency s", 9),
    ("ms/step", 8), ("x floor", 7),
]  # fmt: skip


def format_mode_table(results: list[dict[str, Any]]) -> str:
    """One row per mode: pieces, compiles, cache hits, captures, memory, times, latency. Cells
    are separated by a space, so a value wider than its column (a CPU run's ratio to a GPU-sized
    floor) never runs into the next."""
    header = _table_row([title for title, _ in MODE_TABLE_COLUMNS])
    lines = [header, "-" * len(header)]
    for r in results:
        c = r["counters"]
        compiles = c["num_inductor_compiles"] + c["num_eager_compiles"]
        ratio = r.get("ratio_to_floor")
        cells = [
            r["mode"], r["graph_mode"], c["num_piecewise_graphs_seen"],
            c["num_piecewise_capturable_graphs_seen"], compiles,
            c["num_compiled_artifacts_loaded"], c["num_cudagraph_captured"],
            f"{r['graph_memory_gib']:.3f}", f"{r['compile_s']:.1f}", f"{r['capture_s']:.1f}",
            f"{r['latency_s']['median']:.3f}", f"{r['decode_step_ms']['median']:.2f}",
            f"{ratio:.2f}" if ratio else "-",
        ]  # fmt: skip
        lines.append(_table_row(cells))
    return "\n".join(lines)


def _table_row(cells: list[Any]) -> str:
    return " ".join(
        f"{cell!s:<{-width}}" if width < 0 else f"{cell!s:>{width}}"
        for cell, (_, width) in zip(cells, MODE_TABLE_COLUMNS, strict=True)
    ).rstrip()


def compile_cache_status(result: dict[str, Any]) -> str:
    """``hit (N artifacts loaded)``, ``miss (N compiled, N saved)``, ``partial hit``, or why off."""
    cache, counters = result["compile_cache"], result["counters"]
    if not cache["dirs"]:
        return cache["off_reason"]
    loaded = counters["num_compiled_artifacts_loaded"]
    compiled = counters["num_inductor_compiles"]
    saved = counters["num_compiled_artifacts_saved"]
    if loaded and not compiled:
        return f"hit ({loaded} artifacts loaded)"
    if loaded:
        return f"partial hit ({loaded} artifacts loaded, {compiled} compiled, {saved} saved)"
    return f"miss ({compiled} compiled, {saved} artifacts saved)"


def format_compile_cache(results: list[dict[str, Any]]) -> str:
    """One line per mode: was the compile cache hit, how long compiling took, where it is."""
    lines = []
    for r in results:
        line = (
            f"{r['mode']}: compile cache: {compile_cache_status(r)}; compile {r['compile_s']:.1f} s"
        )
        lines.append(line + "".join(f"\n    {path}" for path in r["compile_cache"]["dirs"]))
    return "\n".join(lines)


def write_json(path: Path, payload: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2))


def plot_latency(path: Path, results: list[dict[str, Any]], title: str) -> bool:
    """Latency per mode against batch size (one line per mode); False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not installed: no plot written (pip install matplotlib)")
        return False
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for mode in dict.fromkeys(r["mode"] for r in results):
        rows = sorted((r for r in results if r["mode"] == mode), key=lambda r: r["batch_size"])
        batches = [r["batch_size"] for r in rows]
        left.plot(batches, [r["latency_s"]["median"] for r in rows], marker="o", label=mode)
        right.plot(batches, [r["decode_step_ms"]["median"] for r in rows], marker="o", label=mode)
    left.set(xlabel="batch size", ylabel="end-to-end latency (s, median)", xscale="log")
    right.set(xlabel="batch size", ylabel="decode step (ms, median)", xscale="log")
    left.legend()
    figure.suptitle(title)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True
