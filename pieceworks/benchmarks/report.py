"""Text and plots of run and benchmark results (what `pieceworks run` and `bench` print)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from pieceworks import envs
from pieceworks.logger import init_logger

logger = init_logger(__name__)


# (title, width, meaning): text columns (negative width) are left-aligned, the others right-aligned.
MODE_TABLE_COLUMNS = [
    ("mode", -18, "the row: a pieceworks mode (eager, compiled, piecewise, full, "
     "full_and_piecewise, ...) or a peer (static_compiled, gpt_fast, hf_eager)"),
    ("lvl", 3, "compile level the row ran at, after the platform's adjustments (0 none, 1 "
     "Dynamo as is, 2 trace once, 3 piecewise); '-' for a peer"),
    ("graphs", -18, "static-graph mode the row ran with, after the platform's adjustments "
     "(NONE where the device has no graphs); 'baseline' for a peer"),
    ("ms/step", 8, "median wall time of a decode step of the whole batch (ms)"),
    ("min", 7, "fastest decode step (ms)"),
    ("max", 7, "slowest decode step (ms)"),
    ("x floor", 7, "ms/step over the floor: bytes a decode step must read (weights, KV) "
     "divided by the device copy bandwidth measured in the same run"),
    ("busy ms", 7, "device-busy time per decode step (ms): the union of kernel and copy "
     "intervals of profiled decode steps; n/a where the platform traces no device work"),
    ("idle", 5, "share of the decode step the device sat idle waiting for the host"),
    ("latency s", 9, "median end-to-end time of one generation of the batch (s)"),
    ("compile s", 9, "compile time at engine start-up (s); '-' where nothing compiles"),
    ("capture s", 9, "static-graph capture time at start-up (s)"),
    ("pieces", 6, "submodules of the split graph (2 per splitting op + 1)"),
    ("capt.", 5, "of those, pieces captured as static graphs"),
    ("compiles", 8, "backend compilations (Inductor or eager) this row ran"),
    ("cache", 5, "compiled artifacts loaded from the compile cache"),
    ("graphs#", 7, "static graphs captured (pieces x capture sizes, + 1 per size for FULL)"),
    ("graph GiB", 9, "memory of the captured graphs' pool (GiB)"),
]  # fmt: skip


def column_help() -> str:
    """What each column of the mode table means (the ``--help`` epilog and docs/performance.md)."""
    width = max(len(title) for title, _, _ in MODE_TABLE_COLUMNS)
    return "columns of the table:\n" + "\n".join(
        f"  {title:<{width}}  {meaning}" for title, _, meaning in MODE_TABLE_COLUMNS
    )


def row_label(r: dict[str, Any]) -> str:
    """The row's name in tables and plots: its mode or peer, then its speculation (``ngram k=4``)
    and its prompt kind where not the default random ids (``full_and_piecewise, ngram k=4,
    repeat``), so rows of one mode that differ in either never share a name."""
    label = r["mode"]
    spec = r.get("speculative")
    if spec:
        label += f", {spec['method']} k={spec['num_speculative_tokens']}"
    if r.get("prompt_kind", "random") != "random":
        label += f", {r['prompt_kind']}"
    return label


def _number(value: Any, spec: str, missing: str = "-") -> str:
    return missing if value is None or value != value else format(value, spec)


# Below this floor (the bytes a decode step must read over the copy bandwidth) a step's fixed
# costs, kernel launches and host work, decide its time: the ratio to the floor then measures the
# model's smallness, not how close the step comes to the memory bound.
MIN_MEANINGFUL_FLOOR_MS = 0.05


def floor_is_meaningful(r: dict[str, Any]) -> bool:
    """The row's floor is large enough for its ``x floor`` ratio to say something."""
    floor = r.get("floor_ms")
    return floor is not None and floor >= MIN_MEANINGFUL_FLOOR_MS


def _row_cells(r: dict[str, Any], only_meaningful_floors: bool = False) -> list[Any]:
    c = r["counters"]
    steps = r["decode_step_ms"]
    busy = r.get("device_busy_ms")
    idle = r.get("device_idle_share")
    level = r.get("level")
    ratio = r.get("ratio_to_floor")
    if only_meaningful_floors and not floor_is_meaningful(r):
        ratio = None
    return [
        row_label(r), "-" if level is None else level, r["graph_mode"],
        _number(steps["median"], ".2f"), _number(steps["min"], ".2f"),
        _number(steps["max"], ".2f"), _number(ratio, ".2f"),
        _number(busy, ".3f", "n/a"), "n/a" if idle is None else f"{idle:.0%}",
        _number(r["latency_s"]["median"], ".3f"), _number(r.get("compile_s"), ".1f"),
        _number(r.get("capture_s"), ".1f"), c["num_piecewise_graphs_seen"],
        c["num_piecewise_capturable_graphs_seen"],
        c["num_inductor_compiles"] + c["num_eager_compiles"], c["num_compiled_artifacts_loaded"],
        c["num_cudagraph_captured"], _number(r.get("graph_memory_gib"), ".3f"),
    ]  # fmt: skip


def format_mode_table(results: list[dict[str, Any]], only_meaningful_floors: bool = False) -> str:
    """One row per measured mode or peer; a failed one shows its error in place of numbers.

    Cells are separated by a space, so a value wider than its column (a CPU run's ratio to a
    GPU-sized floor) never runs into the next. With ``only_meaningful_floors`` (``pieceworks
    run``'s report) ``x floor`` is ``-`` where the floor is below ``MIN_MEANINGFUL_FLOOR_MS``
    (``format_floor_note`` says why); ``bench latency`` shows every ratio.
    """
    mode_width = max([18, *(len(row_label(r)) for r in results)])  # the first column fits all
    header = _table_row([title for title, _, _ in MODE_TABLE_COLUMNS], mode_width)
    lines = [header, "-" * len(header)]
    for r in results:
        if r.get("status", "ok") != "ok":
            lines.append(f"{row_label(r):<{mode_width}} {r.get('status')}: {r.get('error', '')}")
            continue
        lines.append(_table_row(_row_cells(r, only_meaningful_floors), mode_width))
    return "\n".join(lines)


def format_floor_note(results: list[dict[str, Any]]) -> str:
    """Why ``x floor`` is not shown for rows whose floor is too small to mean anything; empty
    when every measured row's ratio is shown."""
    floors = [
        r["floor_ms"]
        for r in results
        if r.get("status", "ok") == "ok"
        and r.get("floor_ms") is not None
        and not floor_is_meaningful(r)
    ]
    if not floors:
        return ""
    return (
        f"x floor not shown: this model's floor is {max(floors) * 1e3:.2g} us per decode step "
        "(the bytes a step must read over the measured copy bandwidth), below "
        f"{MIN_MEANINGFUL_FLOOR_MS * 1e3:.0f} us, where a step's fixed costs (kernel launches, "
        "host work) decide its time; the ratio means something for larger models "
        "(pieceworks bench latency prints it anyway)"
    )


def format_speedups(results: list[dict[str, Any]]) -> str:
    """``decode step vs eager: compiled 1.31x, piecewise 2.05x`` (eager's median ms/step over
    each mode's; above 1 is faster); empty without a measured eager row and another mode."""
    measured = [r for r in results if r.get("status", "ok") == "ok"]
    eager = next((r for r in measured if r["mode"] == "eager"), None)
    others = [r for r in measured if r["mode"] != "eager" and r.get("graph_mode") != "baseline"]
    if eager is None or not others:
        return ""
    base = eager["decode_step_ms"]["median"]
    cells = [f"{row_label(r)} {base / r['decode_step_ms']['median']:.2f}x" for r in others]
    return f"decode step vs eager ({base:.2f} ms): " + ", ".join(cells) + " (above 1x: faster)"


def format_notes(results: list[dict[str, Any]], skipped: list[dict[str, str]]) -> str:
    """Lines under the table: rows that stand for several names, peers skipped and why."""
    lines = [
        f"{r['mode']} also stands for {', '.join(r['merged_modes'])}: the same effective "
        f"configuration (level {r['level']}, {r['graph_mode']}), run once"
        for r in results
        if r.get("merged_modes")
    ]
    lines += [f"skipped {s['mode']}: {s['reason']}" for s in skipped]
    if envs.torch_compile_disabled():
        lines.append(
            "TORCH_COMPILE_DISABLE=1: torch's compiler is off, so every mode ran uncompiled "
            "(level 0, no static graphs)"
        )
    return "\n".join(lines)


def _table_row(cells: list[Any], mode_width: int = 18) -> str:
    widths = [-mode_width] + [width for _, width, _ in MODE_TABLE_COLUMNS[1:]]
    return " ".join(
        f"{cell!s:<{-width}}" if width < 0 else f"{cell!s:>{width}}"
        for cell, width in zip(cells, widths, strict=True)
    ).rstrip()


def compile_cache_status(result: dict[str, Any]) -> str:
    """``hit (N artifacts loaded)``, ``miss (N compiled, N saved)``, ``partial hit``, or why off;
    then ``; traced graph loaded (no Dynamo trace)`` when a warm start skipped the trace."""
    status = _artifact_status(result["compile_cache"], result["counters"])
    if result["counters"].get("num_traced_graphs_loaded"):
        status += "; traced graph loaded (no Dynamo trace)"
    return status


def _artifact_status(cache: dict[str, Any], counters: dict[str, int]) -> str:
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
        if r.get("status", "ok") != "ok" or "compile_cache" not in r:
            continue
        line = f"{r['mode']}: compile cache: {compile_cache_status(r)}"
        if r.get("compile_s") is not None:
            line += f"; compile {r['compile_s']:.1f} s"
        lines.append(line + "".join(f"\n    {path}" for path in r["compile_cache"]["dirs"]))
    return "\n".join(lines)


def write_json(path: Path, payload: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2))


def read_latency_json(names: list[str]) -> list[dict[str, Any]]:
    """The ``bench latency`` payloads among ``names``; any other JSON is skipped with a line on
    stderr saying so (the table scripts take shell globs)."""
    payloads = []
    for name in names:
        payload = json.loads(Path(name).read_text())
        if "results" not in payload:
            print(f"skipping {name}: not a bench latency JSON (no 'results')", file=sys.stderr)
            continue
        payloads.append(payload)
    return payloads


PERFORMANCE_COLUMNS = [
    "model", "dtype", "batch", "mode", "ms/step (min-max)", "x floor", "device busy ms (idle)",
    "peers of the same run, ms/step", "commit", "date", "device", "versions", "command",
]  # fmt: skip


def _peer_cell(peers: list[dict[str, Any]], skipped: list[dict[str, str]]) -> str:
    cells = []
    for peer in peers:
        if peer.get("status", "ok") == "ok":
            ratio = peer.get("ratio_to_floor")
            cells.append(
                f"{peer['mode']} {peer['decode_step_ms']['median']:.2f}"
                + (f" ({ratio:.2f}x)" if ratio else "")
            )
        else:
            cells.append(f"{peer['mode']} failed")
    cells += [f"{s['mode']} skipped" for s in skipped if s.get("reason") != "not in --peers"]
    return "; ".join(cells) or "-"


def _versions_cell(versions: dict[str, str | None]) -> str:
    return ", ".join(f"{name} {version}" for name, version in versions.items() if version)


def performance_rows(payload: dict[str, Any]) -> list[list[str]]:
    """Rows of the performance table for one ``bench latency`` JSON: one per pieceworks mode
    and batch size, with that batch's peers of the same run in one cell."""
    rows = []
    dtype = payload.get("dtype", "?") + (
        f" + {payload['quantization']}" if payload.get("quantization") else ""
    )
    results = payload["results"]
    for r in results:
        if r.get("graph_mode") == "baseline":
            continue
        peers = [
            p
            for p in results
            if p.get("graph_mode") == "baseline"
            and p["batch_size"] == r["batch_size"]
            and p.get("prompt_kind") == r.get("prompt_kind")
        ]
        if r.get("status", "ok") == "ok":
            steps = r["decode_step_ms"]
            step = f"{steps['median']:.3f} ({steps['min']:.3f}-{steps['max']:.3f})"
            ratio = _number(r.get("ratio_to_floor"), ".2f")
            busy = r.get("device_busy_ms")
            idle = r.get("device_idle_share")
            busy_cell = (
                "n/a"
                if busy is None
                else f"{busy:.3f} ({idle:.0%})"
                if idle is not None
                else f"{busy:.3f}"
            )
        else:
            step, ratio, busy_cell = f"failed: {r.get('error', '')}", "-", "-"
        mode = f"{row_label(r)} (level {r.get('level')}, {r.get('graph_mode')})"
        if (r.get("num_scheduler_steps") or 1) > 1:  # a row of its own beside one step per trip
            mode += f", {r['num_scheduler_steps']} decode steps per round trip"
        rows.append([
            payload["model"], dtype, str(r["batch_size"]), mode, step, ratio, busy_cell,
            _peer_cell(peers, payload.get("skipped", [])), str(payload.get("commit", "?")),
            str(payload.get("date", "?")), str(payload.get("device", "?")),
            _versions_cell(payload.get("versions", {})), f"`{payload.get('command') or '?'}`",
        ])  # fmt: skip
    return rows


def format_performance_table(payloads: list[dict[str, Any]]) -> str:
    """The markdown table of ``docs/performance.md`` from ``bench latency`` JSON payloads: one
    row per model, dtype, batch size and mode, the newest run's where several measured it (the
    others stay in their JSON), in the order the configurations first appear."""
    date = PERFORMANCE_COLUMNS.index("date")
    newest: dict[tuple[str, ...], list[str]] = {}
    for payload in payloads:
        for row in performance_rows(payload):
            key = tuple(row[:4])  # model, dtype, batch, mode
            if key not in newest or row[date] > newest[key][date]:  # "YYYY-MM-DD HH:MM UTC"
                newest[key] = row
    lines = [
        "| " + " | ".join(PERFORMANCE_COLUMNS) + " |",
        "|"
        + "|".join(
            "---:" if title in ("batch", "x floor") else "---" for title in PERFORMANCE_COLUMNS
        )
        + "|",
    ]
    lines += [
        "| " + " | ".join(cell.replace("|", "/") for cell in row) + " |" for row in newest.values()
    ]
    return "\n".join(lines)


def plot_latency(path: Path, results: list[dict[str, Any]], title: str) -> bool:
    """Decode ms per step as bars, one group per batch size and one bar per mode or peer, with
    min-max whiskers and the floor drawn across each group; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not installed: no plot written (pip install matplotlib)")
        return False
    measured = [r for r in results if r.get("status", "ok") == "ok"]
    names = list(dict.fromkeys(row_label(r) for r in measured))
    batches = sorted({r["batch_size"] for r in measured})
    if not names:
        logger.warning("no measured rows: no plot written")
        return False
    width = 0.8 / len(names)
    figure, axes = plt.subplots(figsize=(max(6.0, 1.2 + 0.55 * len(names) * len(batches)), 4.2))
    for index, name in enumerate(names):
        rows = {r["batch_size"]: r for r in measured if row_label(r) == name}
        xs = [group + (index - (len(names) - 1) / 2) * width for group, b in enumerate(batches)]
        steps = [rows[b]["decode_step_ms"] if b in rows else None for b in batches]
        medians = [s["median"] if s else 0.0 for s in steps]
        errors = [
            [s["median"] - s["min"] if s else 0.0 for s in steps],
            [s["max"] - s["median"] if s else 0.0 for s in steps],
        ]
        bars = axes.bar(xs, medians, width * 0.95, yerr=errors, capsize=3, label=name)
        axes.bar_label(bars, labels=[f"{m:.2f}" if m else "" for m in medians], fontsize=7)
    for group, batch in enumerate(batches):
        floors = [r["floor_ms"] for r in measured if r["batch_size"] == batch and r.get("floor_ms")]
        if floors:
            axes.hlines(floors[0], group - 0.45, group + 0.45, colors="black", linestyles="--",
                        label="floor" if group == 0 else "_nolegend_")  # fmt: skip
    axes.set_xticks(range(len(batches)), [f"batch {b}" for b in batches])
    axes.set_ylabel("decode step (ms, median; whiskers min-max)")
    axes.legend(fontsize=8, ncols=2)
    axes.set_title(title, fontsize=10)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True
