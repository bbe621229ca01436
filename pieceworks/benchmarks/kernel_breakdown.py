"""A decode step's device time, kernel by kernel: the budget behind its device-busy number.

``device_busy.profile_device_busy`` hands the profile's trace here (``bench latency
--kernel-breakdown``). From the same events that give device-busy, ``kernel_breakdown`` counts
the kernels a step launches (and per decoder layer), sums their time, finds the holes where the
device ran nothing, and groups the kernels by name (``normalize_kernel_name``: Inductor's numeric
suffix dropped, so the same fused kernel of every layer is one group).

Steps are told apart on the host: the caller wraps each engine step call in
``torch.profiler.record_function(STEP_ANNOTATION)``, and each device event belongs to the step
call that launched it (the runtime call with its ``correlation`` id, or, for events with none,
the event's own start). A hole in the device timeline counts as inside a step where it lies
between the first and the last device event of one step call; the others lie between steps. Seeing
the annotations and the runtime calls needs the profiler's CPU activity as well, which slows the
host: kernel counts, kernel times and device-busy do not change, holes that wait on the host
(between steps, and between the pieces of a PIECEWISE step) may grow.

This module only reads event lists; it runs nothing and knows no platform.
"""

from __future__ import annotations

import bisect
import re
import statistics
from dataclasses import dataclass
from typing import Any

STEP_ANNOTATION = "pieceworks::decode_step"
COPY_CATEGORIES = ("gpu_memcpy", "gpu_memset")  # device work that is not a kernel launch
NUM_TOP_KERNELS = 10

_INDUCTOR_SUFFIX = re.compile(r"^(triton_\w+?)_\d+$")


@dataclass(frozen=True)
class DeviceEvent:
    """One interval of device work: a kernel, copy or memset, and the step call that launched it
    (``None`` where it was launched outside every annotated step)."""

    name: str
    start_us: float
    duration_us: float
    step: int | None = None
    is_kernel: bool = True

    @property
    def end_us(self) -> float:
        return self.start_us + self.duration_us


def normalize_kernel_name(name: str) -> str:
    """``name`` without what differs between copies of one kernel: Inductor's ``_<n>`` suffix
    (``triton_red_fused_add_mean_3`` → ``triton_red_fused_add_mean``), a leading ``void`` and the
    trailing parameter list of a C++ kernel's signature (its template arguments stay)."""
    name = name.strip().removeprefix("void ")
    if name.endswith(")"):
        depth = 0
        for index in range(len(name) - 1, -1, -1):
            depth += {")": 1, "(": -1}.get(name[index], 0)
            if depth == 0:
                name = name[:index].rstrip() if index else name
                break
    match = _INDUCTOR_SUFFIX.match(name)
    return match.group(1) if match else name


def merged_intervals(events: list[DeviceEvent]) -> list[tuple[float, float]]:
    """The device timeline's busy stretches: ``events``' intervals, overlaps joined."""
    merged: list[tuple[float, float]] = []
    for event in sorted(events, key=lambda e: e.start_us):
        if merged and event.start_us <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], event.end_us))
        else:
            merged.append((event.start_us, event.end_us))
    return merged


def step_spans(events: list[DeviceEvent]) -> list[tuple[float, float]]:
    """Per step call, from its first device event's start to its last one's end."""
    spans: dict[int, tuple[float, float]] = {}
    for event in events:
        if event.step is None:
            continue
        start, end = spans.get(event.step, (event.start_us, event.end_us))
        spans[event.step] = (min(start, event.start_us), max(end, event.end_us))
    return sorted(spans.values())


def split_holes(
    busy: list[tuple[float, float]], spans: list[tuple[float, float]]
) -> tuple[list[float], list[float]]:
    """The holes between consecutive busy stretches, as (inside a step span, between steps)."""
    inside: list[float] = []
    between: list[float] = []
    for (_, hole_start), (hole_end, _) in zip(busy, busy[1:]):
        within = any(start <= hole_start and hole_end <= end for start, end in spans)
        (inside if within else between).append(hole_end - hole_start)
    return inside, between


def top_kernels(events: list[DeviceEvent], num_steps: int, limit: int) -> list[dict[str, Any]]:
    """The ``limit`` kernel names (normalized) with the most device time, per step."""
    groups: dict[str, list[float]] = {}
    for event in events:
        groups.setdefault(normalize_kernel_name(event.name), []).append(event.duration_us)
    total_us = sum(event.duration_us for event in events) or 1.0
    ranked = sorted(groups.items(), key=lambda item: -sum(item[1]))[:limit]
    return [
        {
            "name": name,
            "num_per_step": len(durations) / num_steps,
            "mean_us": statistics.fmean(durations),
            "us_per_step": sum(durations) / num_steps,
            "share": sum(durations) / total_us,  # of all device time the events took
        }
        for name, durations in ranked
    ]


def kernel_breakdown(
    events: list[DeviceEvent], num_steps: int, num_layers: int | None
) -> dict[str, Any]:
    """The per-kernel budget of ``num_steps`` profiled steps (the ``kernel_breakdown`` object)."""
    num_kernels = sum(event.is_kernel for event in events)
    busy = merged_intervals(events)
    spans = step_spans(events)
    inside, between = split_holes(busy, spans)
    kernels_per_step = num_kernels / num_steps
    kernel_ms = sum(event.duration_us for event in events) / 1e3 / num_steps
    busy_ms = sum(end - start for start, end in busy) / 1e3 / num_steps
    return {
        "measured": True,
        "num_steps": num_steps,
        "num_layers": num_layers,
        "kernels_per_step": kernels_per_step,
        "kernels_per_layer": kernels_per_step / num_layers if num_layers else None,
        "copies_per_step": (len(events) - num_kernels) / num_steps,
        "kernel_ms_per_step": kernel_ms,
        "device_busy_ms": busy_ms,
        # Kernel time spent while another kernel ran: concurrent kernels, or under programmatic
        # dependent launch a kernel started early and waiting for the one before it (its wait
        # is in its time, so the small kernels that follow a GEMV look slower than they are).
        "overlap_ms_per_step": max(0.0, kernel_ms - busy_ms),
        "gaps": {
            "sum_us_per_step": sum(inside) / num_steps if spans else None,
            "median_us": statistics.median(inside) if inside else None,
            "num_per_step": len(inside) / num_steps if spans else None,
            "between_steps_us_per_step": sum(between) / num_steps if spans else None,
        },
        "top_kernels": top_kernels(events, num_steps, NUM_TOP_KERNELS),
        # device events no annotated step call launched (0 where every step call is annotated)
        "num_outside_steps": sum(event.step is None for event in events),
        "note": None
        if spans
        else "no device event belongs to an annotated step call: gaps not split by step",
    }


def not_measured_breakdown(reason: str) -> dict[str, Any]:
    """The ``kernel_breakdown`` object where nothing was profiled, with the reason."""
    return {"measured": False, "note": reason}


def device_events_from_trace(
    trace_events: list[dict[str, Any]], device_categories: tuple[str, ...]
) -> list[DeviceEvent]:
    """The device events of a Chrome trace (``export_chrome_trace``), each with its step call."""
    annotations = sorted(
        (e["ts"], e["ts"] + e["dur"])
        for e in trace_events
        if e.get("name") == STEP_ANNOTATION and e.get("cat") == "user_annotation"
    )
    starts = [start for start, _ in annotations]
    launches = {  # correlation id → when the host launched it (cudaLaunchKernel, a graph launch)
        e["args"]["correlation"]: e["ts"]
        for e in trace_events
        if e.get("ph") == "X"
        and e.get("cat") not in device_categories
        and "correlation" in e.get("args", {})
    }

    def step_of(event: dict[str, Any]) -> int | None:
        launched = launches.get(event.get("args", {}).get("correlation"), event["ts"])
        index = bisect.bisect_right(starts, launched) - 1
        return index if index >= 0 and launched <= annotations[index][1] else None

    return [
        DeviceEvent(e["name"], e["ts"], e["dur"], step_of(e), e["cat"] not in COPY_CATEGORIES)
        for e in trace_events
        if e.get("cat") in device_categories
    ]
