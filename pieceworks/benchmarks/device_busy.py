"""Device-busy time of decode steps: how long the device itself worked per step.

A decode step's wall time is the device's work plus the time the device sat idle waiting for the
host. ``profile_device_busy`` runs a few steps under ``torch.profiler`` with the activity the
platform names (``Platform.profiler_activity()``: CUPTI on NVIDIA, roctracer on AMD), and returns
the union of the device's kernel, copy and memset intervals divided by the number of steps
(intervals that overlap, on two streams, count once). The steps run between two device syncs, so
the trace holds exactly their work. Where the platform traces no device activity (the CPU, whose
"device" work is the host's own), there is no device-busy time: the result says "n/a" and why,
never a made-up number.

With ``kernel_breakdown=True`` the same profile also yields the per-kernel budget of a step
(``benchmarks.kernel_breakdown``; the profiler then traces the host too, to tell steps apart).

``engine_device_busy`` drives an ``LLM``'s engine to the uniform-decode steps of the whole batch
and profiles those; the baselines call ``profile_device_busy`` on their own decode steps.
Used by ``benchmarks.latency`` (``pieceworks run``, ``bench latency``) and ``benchmarks.baselines``.
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from pieceworks.benchmarks.kernel_breakdown import (
    STEP_ANNOTATION,
    device_events_from_trace,
    kernel_breakdown,
    not_measured_breakdown,
)
from pieceworks.platforms import current_platform

DEVICE_EVENT_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
NUM_PROFILED_STEPS = 12  # enough that one step's spill at the window's edge stays small


def union_length(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by ``intervals`` (overlaps counted once)."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total


def not_measured(reason: str, breakdown: bool = False) -> dict[str, Any]:
    """The device-busy fields of a result where nothing was measured, with the reason (and the
    ``kernel_breakdown`` object saying the same, where one was asked for)."""
    fields = {"device_busy_ms": None, "device_idle_share": None, "device_busy_note": reason}
    return {**fields, "kernel_breakdown": not_measured_breakdown(reason)} if breakdown else fields


def profile_device_busy(
    run_steps: Callable[[], int | None],
    num_steps: int,
    *,
    breakdown: bool = False,
    num_layers: int | None = None,
) -> dict[str, Any]:
    """Profile ``run_steps()`` (which runs ``num_steps`` steps, or as many as it returns);
    device-busy ms per step, and with ``breakdown`` the ``kernel_breakdown`` object of the same
    profile (``num_layers``: the decoder layers a step runs, for kernels per layer)."""
    platform = current_platform()
    activity = platform.profiler_activity()
    if activity is None:
        return not_measured(f"n/a: platform {platform.name} traces no device activity", breakdown)
    activities = [activity]
    if breakdown and activity != torch.profiler.ProfilerActivity.CPU:
        activities.append(torch.profiler.ProfilerActivity.CPU)  # step annotations, launches
    platform.synchronize()
    with torch.profiler.profile(activities=activities) as profiler:
        start = time.perf_counter()
        num_steps = run_steps() or num_steps
        platform.synchronize()
        wall_seconds = time.perf_counter() - start
    with tempfile.TemporaryDirectory() as directory:
        trace_path = Path(directory) / "trace.json"
        profiler.export_chrome_trace(str(trace_path))
        events = json.loads(trace_path.read_text())["traceEvents"]
    device_events = [e for e in events if e.get("cat") in DEVICE_EVENT_CATEGORIES]
    if not device_events:
        reason = f"n/a: the profiler recorded no device work on {platform.name}"
        return not_measured(reason, breakdown)
    busy_us = union_length([(e["ts"], e["ts"] + e["dur"]) for e in device_events])
    result: dict[str, Any] = {
        "device_busy_ms": busy_us / 1e3 / num_steps,
        "device_idle_share": None,  # set against the unprofiled step time by ``with_idle_share``
        "device_busy_note": f"{num_steps} decode steps profiled "
        f"({wall_seconds * 1e3 / num_steps:.3f} ms/step wall under the profiler)",
    }
    if breakdown:
        events = device_events_from_trace(events, DEVICE_EVENT_CATEGORIES)
        result["kernel_breakdown"] = kernel_breakdown(events, num_steps, num_layers)
    return result


def with_idle_share(busy: dict[str, Any], step_ms: float) -> dict[str, Any]:
    """``busy`` with the share of an (unprofiled) ``step_ms`` step the device sat idle."""
    if busy["device_busy_ms"] is None or not step_ms or step_ms != step_ms:  # None or NaN
        return busy
    return {**busy, "device_idle_share": max(0.0, 1.0 - busy["device_busy_ms"] / step_ms)}


def engine_device_busy(
    llm: Any,
    prompts: list[list[int]],
    params: Any,
    num_steps: int = NUM_PROFILED_STEPS,
    breakdown: bool = False,
) -> dict[str, Any]:
    """Device-busy ms per uniform-decode step of the whole batch, for ``llm``'s engine (with
    ``breakdown``, also its ``kernel_breakdown``; each step call annotated as one step).

    Queues ``prompts``, steps until every request decodes, profiles about ``num_steps`` steps
    (fewer when ``params.max_tokens`` leaves fewer; with multi-step decode whole ``step`` calls
    of ``num_scheduler_steps`` steps, counted as they ran), then runs the requests to their end.
    """
    if current_platform().profiler_activity() is None:  # the "n/a" answer, without a step
        return profile_device_busy(lambda: None, 1, breakdown=breakdown)
    engine = llm.engine
    batch_size = len(prompts)
    requests = [engine.add_request(prompt, params) for prompt in prompts]
    engine.step_seconds.clear()
    while engine.has_unfinished_requests() and not _decoding_whole_batch(engine, batch_size):
        engine.step()
    engine.step()  # one more, so the window starts after the first full-batch decode step
    # Each request is one step call behind while one is in flight (async scheduling).
    steps_per_call = engine.scheduler.num_scheduler_steps
    remaining = min(params.max_tokens - len(r.output_token_ids) for r in requests)
    remaining -= 2 * steps_per_call
    num_calls = min(-(-num_steps // steps_per_call), remaining // steps_per_call)
    if num_calls * steps_per_call < 2:
        _drain(engine)
        return not_measured("n/a: too few decode steps to profile (raise --output-len)", breakdown)
    engine.step_seconds.clear()

    def run_steps() -> int:
        for _ in range(num_calls):
            with torch.profiler.record_function(STEP_ANNOTATION):
                engine.step()
        return len(engine.step_seconds)  # one entry per decode step run

    num_layers = llm.config.model_config.hf_config.get("num_hidden_layers")
    busy = profile_device_busy(
        run_steps, num_calls * steps_per_call, breakdown=breakdown, num_layers=num_layers
    )
    uniform = all(u and n == batch_size for u, n, _ in engine.step_seconds)
    _drain(engine)
    if not uniform:
        reason = "n/a: a profiled step was not a decode step of the whole batch"
        return not_measured(reason, breakdown)
    return busy


def _decoding_whole_batch(engine: Any, batch_size: int) -> bool:
    if not engine.step_seconds:
        return False
    uniform, num_requests, _ = engine.step_seconds[-1]
    return bool(uniform and num_requests == batch_size)


def _drain(engine: Any) -> None:
    while engine.has_unfinished_requests():
        engine.step()
