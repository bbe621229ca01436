"""Per-step times of a loop of device steps, without a host sync between the steps.

A peer's decode loop launches step after step; the host runs ahead and the device works through
the queue, as in the engine's own steady state (async scheduling). Syncing around each step
instead would add the host's launch latency to every step and measure a loop nobody runs. So
where the platform has timing events, an event is recorded after each step and the step's time
is the interval between consecutive events on the device's timeline: back-to-back steps, the
device's idle gaps included when the host falls behind. Where device work completes before the
host call returns (the CPU), the host clock around each step is that time.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

from pieceworks.platforms import current_platform

T = TypeVar("T")


def timed_steps(step: Callable[[], T], num_steps: int, step_seconds: list[float]) -> list[T]:
    """Run ``step()`` ``num_steps`` times; append each step's seconds to ``step_seconds``."""
    platform = current_platform()
    start = platform.create_event(timing=True)
    results = []
    if start is None:
        for _ in range(num_steps):
            begin = time.perf_counter()
            results.append(step())
            step_seconds.append(time.perf_counter() - begin)
        return results
    platform.synchronize()
    start.record()
    ends = []
    for _ in range(num_steps):
        results.append(step())
        end: Any = platform.create_event(timing=True)
        end.record()
        ends.append(end)
    platform.synchronize()
    for earlier, later in zip([start, *ends], ends):
        step_seconds.append(earlier.elapsed_time(later) / 1e3)  # elapsed_time is in ms
    return results
