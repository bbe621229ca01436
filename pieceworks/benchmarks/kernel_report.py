"""Reading ``kernel_breakdown`` objects: the compact table ``bench latency --kernel-breakdown``
prints, and the markdown budget table of ``docs/performance.md`` (``benchmarks/kernel_table.py``).

The objects come from ``benchmarks.kernel_breakdown`` through each ``bench latency`` JSON row;
this module only formats them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

NUM_PRINTED_KERNELS = 5
MAX_NAME_CHARS = 48


def _short(name: str, width: int = MAX_NAME_CHARS) -> str:
    return name if len(name) <= width else name[: width - 3] + "..."


def _number(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _breakdown_rows(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in results if r.get("status", "ok") == "ok" and "kernel_breakdown" in r]


def format_kernel_breakdown(results: list[dict[str, Any]]) -> str:
    """Per row with a breakdown: kernels and copies per step and per layer, kernel and busy ms,
    the holes inside and between steps, then its top kernels; empty when no row has one."""
    rows = _breakdown_rows(results)
    if not rows:
        return ""
    lines = [
        "kernel breakdown, per decode step (gaps: device idle between kernels inside a step; "
        "under each row its top kernels: share of kernel time, launches per step, mean time; "
        "kernel ms above busy ms is time kernels overlapped: under programmatic dependent launch "
        "a kernel launched early counts its wait, PIECEWORKS_PDL=0 gives each kernel's own time)",
        f"{'batch':>5} {'mode':<20} {'kernels':>8} {'/layer':>7} {'copies':>6} "
        f"{'kernel ms':>9} {'busy ms':>8} {'gap us':>8} {'gaps':>6} {'median us':>9} "
        f"{'between us':>10}",
    ]
    for r in rows:
        breakdown = r["kernel_breakdown"]
        if not breakdown.get("measured"):
            lines.append(f"{r['batch_size']:>5} {r['mode']:<20} {breakdown.get('note')}")
            continue
        gaps = breakdown["gaps"]
        lines.append(
            f"{r['batch_size']:>5} {r['mode']:<20} {breakdown['kernels_per_step']:>8.1f} "
            f"{_number(breakdown['kernels_per_layer'], '.1f'):>7} "
            f"{breakdown['copies_per_step']:>6.1f} {breakdown['kernel_ms_per_step']:>9.3f} "
            f"{breakdown['device_busy_ms']:>8.3f} {_number(gaps['sum_us_per_step'], '.1f'):>8} "
            f"{_number(gaps['num_per_step'], '.1f'):>6} {_number(gaps['median_us'], '.2f'):>9} "
            f"{_number(gaps['between_steps_us_per_step'], '.1f'):>10}"
        )
        for kernel in breakdown["top_kernels"][:NUM_PRINTED_KERNELS]:
            lines.append(
                f"{'':>6}{kernel['share']:>5.0%} {kernel['num_per_step']:>6.1f}x "
                f"{kernel['mean_us']:>8.2f} us  {_short(kernel['name'], 80)}"
            )
    return "\n".join(lines)


BUDGET_COLUMNS = [
    "model", "mode", "batch", "step ms", "device-busy ms", "floor ms", "kernels/step",
    "kernels/layer", "gap sum us", "top 5 kernels (share of kernel time)",
]  # fmt: skip


def _top_cell(kernels: list[dict[str, Any]]) -> str:
    return "; ".join(
        f"`{_short(k['name'])}` {k['share']:.0%}" for k in kernels[:NUM_PRINTED_KERNELS]
    )


def budget_rows(payload: dict[str, Any]) -> list[list[str]]:
    """One budget-table row per measured pieceworks row of a ``bench latency`` JSON whose
    breakdown was measured; rows without one are left out."""
    model = Path(payload["model"]).name  # a checkpoint directory by its last component
    rows = []
    for r in _breakdown_rows(payload["results"]):
        breakdown = r["kernel_breakdown"]
        if not breakdown.get("measured") or r.get("graph_mode") == "baseline":
            continue
        rows.append([
            model, r["mode"], str(r["batch_size"]), _number(r["decode_step_ms"]["median"], ".3f"),
            _number(r.get("device_busy_ms"), ".3f"), _number(r.get("floor_ms"), ".3f"),
            f"{breakdown['kernels_per_step']:.0f}", _number(breakdown["kernels_per_layer"], ".1f"),
            _number(breakdown["gaps"]["sum_us_per_step"], ".1f"),
            _top_cell(breakdown["top_kernels"]),
        ])  # fmt: skip
    return rows


def format_budget_table(payloads: list[dict[str, Any]]) -> str:
    """The markdown budget table of ``docs/performance.md``, rows in the payloads' order."""
    numeric = set(BUDGET_COLUMNS[2:-1])
    lines = [
        "| " + " | ".join(BUDGET_COLUMNS) + " |",
        "|" + "|".join("---:" if title in numeric else "---" for title in BUDGET_COLUMNS) + "|",
    ]
    for payload in payloads:
        lines += [
            "| " + " | ".join(cell.replace("|", "/") for cell in row) + " |"
            for row in budget_rows(payload)
        ]
    return "\n".join(lines)
