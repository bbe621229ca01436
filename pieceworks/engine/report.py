"""Text and plots of run and benchmark results (what `pieceworks run` and `bench` print)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pieceworks.logger import init_logger

logger = init_logger(__name__)


def format_mode_table(results: list[dict[str, Any]]) -> str:
    """One row per mode: pieces, compiles, cache hits, captures, memory, times, latency."""
    header = (
        f"{'mode':<20}{'graphs':<20}{'pieces':>7}{'capt.':>6}{'compiles':>9}{'cache':>6}"
        f"{'graphs#':>8}{'graph GiB':>10}{'compile s':>10}{'capture s':>10}"
        f"{'latency s':>10}{'ms/step':>9}{'x floor':>8}"
    )
    lines = [header, "-" * len(header)]
    for r in results:
        c = r["counters"]
        compiles = c["num_inductor_compiles"] + c["num_eager_compiles"]
        ratio = r.get("ratio_to_floor")
        lines.append(
            f"{r['mode']:<20}{r['graph_mode']:<20}{c['num_piecewise_graphs_seen']:>7}"
            f"{c['num_piecewise_capturable_graphs_seen']:>6}{compiles:>9}"
            f"{c['num_compiled_artifacts_loaded']:>6}{c['num_cudagraph_captured']:>8}"
            f"{r['graph_memory_gib']:>10.3f}{r['compile_s']:>10.1f}{r['capture_s']:>10.1f}"
            f"{r['latency_s']['median']:>10.3f}{r['decode_step_ms']['median']:>9.2f}"
            f"{(f'{ratio:.2f}' if ratio else '-'):>8}"
        )
    return "\n".join(lines)


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
