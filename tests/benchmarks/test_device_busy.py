"""Device-busy time: interval union, the honest "n/a" where the platform traces no device work,
and the profile-to-number path (with the CPU's own op events standing in for device kernels).

Run: pytest tests/benchmarks/test_device_busy.py
"""

from __future__ import annotations

import torch

from pieceworks.benchmarks import device_busy
from pieceworks.benchmarks.device_busy import (
    profile_device_busy,
    union_length,
    with_idle_share,
)
from pieceworks.platforms import current_platform


def test_union_counts_overlaps_once():
    assert union_length([(0, 2), (1, 3), (5, 6), (5.5, 5.7)]) == 4
    assert union_length([]) == 0


def test_cpu_reports_n_a_not_a_number():
    assert current_platform().profiler_activity() is None
    busy = profile_device_busy(lambda: None, 4)
    assert busy["device_busy_ms"] is None and busy["device_idle_share"] is None
    assert busy["device_busy_note"].startswith("n/a: platform cpu")
    assert with_idle_share(busy, 2.0) == busy


def test_profiled_intervals_become_busy_ms_per_step(monkeypatch):
    platform = current_platform()
    monkeypatch.setattr(
        type(platform), "profiler_activity", lambda self: torch.profiler.ProfilerActivity.CPU
    )
    monkeypatch.setattr(device_busy, "DEVICE_EVENT_CATEGORIES", ("cpu_op",))
    x = torch.randn(256, 256)

    def steps():
        for _ in range(4):
            x @ x

    busy = profile_device_busy(steps, 4)
    assert busy["device_busy_ms"] > 0
    assert "4 decode steps profiled" in busy["device_busy_note"]
    share = with_idle_share(busy, busy["device_busy_ms"] * 4)["device_idle_share"]
    assert abs(share - 0.75) < 1e-9
