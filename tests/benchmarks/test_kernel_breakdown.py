"""The per-kernel budget of a decode step (``bench latency --kernel-breakdown``):

- on synthetic events: kernels per step and per layer, kernel time against device-busy and
  the overlap between them (two streams overlap), holes inside a step against holes between
  steps, name grouping with Inductor's suffixes dropped;
- from a Chrome trace: each device event belongs to the step call that launched it (graph
  kernels by their launch's correlation id, not by when they ran);
- on the CPU the profile has no device work: the breakdown is a ``measured: false`` object with
  the reason, in the JSON row and the printed table; with the CPU's own ops standing in for
  device kernels the same engine path yields a measured object;
- the markdown budget table renders the JSON rows.

Run: pytest tests/benchmarks/test_kernel_breakdown.py
"""

from __future__ import annotations

import json

import pytest
import torch

from pieceworks.benchmarks import device_busy, latency
from pieceworks.benchmarks.kernel_breakdown import (
    STEP_ANNOTATION,
    DeviceEvent,
    device_events_from_trace,
    kernel_breakdown,
    normalize_kernel_name,
)
from pieceworks.benchmarks.kernel_report import format_budget_table, format_kernel_breakdown
from pieceworks.entrypoints.cli import main
from pieceworks.platforms import current_platform


def _two_steps() -> list[DeviceEvent]:
    """Two steps of a 2-layer model: per step a copy, two layers of (norm, gemm), and a
    sampler kernel that overlaps the last gemm on a second stream."""
    events = []
    for step, base in enumerate((0.0, 100.0)):
        events += [
            DeviceEvent("Memcpy HtoD (Pinned -> Device)", base, 2.0, step, is_kernel=False),
            DeviceEvent("triton_red_fused_add_mean_0", base + 3.0, 4.0, step),  # hole 1 us
            DeviceEvent("nvjet_gemm", base + 8.0, 10.0, step),  # hole 1
            DeviceEvent("triton_red_fused_add_mean_1", base + 20.0, 4.0, step),  # hole 2
            DeviceEvent("nvjet_gemm", base + 24.0, 10.0, step),  # no hole
            DeviceEvent("sample_kernel", base + 30.0, 6.0, step),  # overlaps the gemm by 4
        ]
    return events  # step 0 spans 0..36, step 1 100..136: the hole 36..100 is between steps


def test_counts_times_and_holes_of_synthetic_steps():
    breakdown = kernel_breakdown(_two_steps(), num_steps=2, num_layers=2)
    assert breakdown["measured"] is True
    assert breakdown["kernels_per_step"] == 5 and breakdown["copies_per_step"] == 1
    assert breakdown["kernels_per_layer"] == 2.5  # 5 kernels over 2 layers
    assert breakdown["kernel_ms_per_step"] == pytest.approx(36e-3)  # 2 + 4 + 10 + 4 + 10 + 6
    assert breakdown["device_busy_ms"] == pytest.approx(32e-3)  # 36 - 4 us of overlap
    assert breakdown["overlap_ms_per_step"] == pytest.approx(4e-3)  # kernels that ran at once
    gaps = breakdown["gaps"]
    assert gaps["sum_us_per_step"] == pytest.approx(4.0)  # holes of 1, 1 and 2 us
    assert gaps["num_per_step"] == 3 and gaps["median_us"] == 1.0
    assert gaps["between_steps_us_per_step"] == pytest.approx(64 / 2)  # 36..100, once in 2
    assert breakdown["note"] is None and breakdown["num_outside_steps"] == 0


def test_top_kernels_group_the_copies_of_one_kernel():
    top = kernel_breakdown(_two_steps(), num_steps=2, num_layers=2)["top_kernels"]
    assert [k["name"] for k in top] == [
        "nvjet_gemm",
        "triton_red_fused_add_mean",  # _0 and _1: one group
        "sample_kernel",
        "Memcpy HtoD",
    ]
    gemm, norm = top[0], top[1]
    assert (gemm["num_per_step"], gemm["mean_us"], gemm["us_per_step"]) == (2, 10.0, 20.0)
    assert gemm["share"] == pytest.approx(20 / 36)
    assert (norm["num_per_step"], norm["mean_us"]) == (2, 4.0)
    assert sum(k["share"] for k in top) == pytest.approx(1.0)


def test_without_step_annotations_the_holes_are_not_split():
    events = [DeviceEvent(e.name, e.start_us, e.duration_us) for e in _two_steps()]
    breakdown = kernel_breakdown(events, num_steps=2, num_layers=None)
    assert breakdown["gaps"]["sum_us_per_step"] is None
    assert breakdown["kernels_per_layer"] is None
    assert "no device event belongs to an annotated step call" in breakdown["note"]
    assert breakdown["num_outside_steps"] == len(events)


@pytest.mark.parametrize(
    ("name", "normalized"),
    [
        ("triton_poi_fused_mul_silu_12", "triton_poi_fused_mul_silu"),
        ("triton_red_fused_add_mean_pow_rsqrt_0", "triton_red_fused_add_mean_pow_rsqrt"),
        ("_gemv_kernel", "_gemv_kernel"),  # a hand-written Triton kernel keeps its name
        (
            "void at::native::elementwise_kernel<128, 2>(int, float)",
            "at::native::elementwise_kernel<128, 2>",
        ),  # noqa: E501
        ("Memset (Device)", "Memset"),
    ],
)
def test_normalize_kernel_name(name, normalized):
    assert normalize_kernel_name(name) == normalized


def test_trace_events_belong_to_the_step_call_that_launched_them():
    trace = [
        {"ph": "X", "cat": "user_annotation", "name": STEP_ANNOTATION, "ts": 0, "dur": 10},
        {"ph": "X", "cat": "user_annotation", "name": STEP_ANNOTATION, "ts": 10, "dur": 10},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 2, "dur": 1,
         "args": {"correlation": 7}},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 12, "dur": 1,
         "args": {"correlation": 8}},
        # both kernels of the graph launched in step 0 run during step call 1 on the host
        {"ph": "X", "cat": "kernel", "name": "k_a", "ts": 11, "dur": 2, "args": {"correlation": 7}},
        {"ph": "X", "cat": "kernel", "name": "k_b", "ts": 14, "dur": 2, "args": {"correlation": 7}},
        {"ph": "X", "cat": "kernel", "name": "k_c", "ts": 17, "dur": 2, "args": {"correlation": 8}},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy", "ts": 30, "dur": 1, "args": {}},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 3, "dur": 1, "args": {}},
    ]  # fmt: skip
    events = device_events_from_trace(trace, device_busy.DEVICE_EVENT_CATEGORIES)
    assert [(e.name, e.step, e.is_kernel) for e in events] == [
        ("k_a", 0, True),
        ("k_b", 0, True),
        ("k_c", 1, True),
        ("Memcpy", None, False),  # launched after the last annotated step
    ]


def test_cpu_reports_the_breakdown_not_measured():
    assert current_platform().profiler_activity() is None
    busy = device_busy.profile_device_busy(lambda: None, 4, breakdown=True)
    assert busy["kernel_breakdown"] == {
        "measured": False,
        "note": "n/a: platform cpu traces no device activity",
    }
    assert "kernel_breakdown" not in device_busy.profile_device_busy(lambda: None, 4)


@pytest.fixture
def cpu_ops_as_device_work(monkeypatch):
    """The CPU's own op events stand in for device kernels (as in test_device_busy.py)."""
    platform = current_platform()
    monkeypatch.setattr(
        type(platform), "profiler_activity", lambda self: torch.profiler.ProfilerActivity.CPU
    )
    monkeypatch.setattr(device_busy, "DEVICE_EVENT_CATEGORIES", ("cpu_op",))


def test_profiled_annotated_steps_become_a_breakdown(cpu_ops_as_device_work):
    x = torch.ones(8)

    def steps():
        for _ in range(3):
            with torch.profiler.record_function(STEP_ANNOTATION):
                x.add_(1)

    busy = device_busy.profile_device_busy(steps, 3, breakdown=True, num_layers=1)
    breakdown = busy["kernel_breakdown"]
    assert breakdown["measured"] and breakdown["note"] is None
    top = {k["name"]: k for k in breakdown["top_kernels"]}
    assert top["aten::add_"]["num_per_step"] == 1
    assert breakdown["device_busy_ms"] == pytest.approx(busy["device_busy_ms"])


TINY = ["--model", "llama-tiny", "--batch-size", "1", "--input-len", "4", "--num-iters-warmup",
        "0", "--num-iters", "1", "--dtype", "float32", "--modes", "eager",
        "--kernel-breakdown"]  # fmt: skip


def _bench(tmp_path, monkeypatch, *flags: str) -> tuple[int, dict]:
    monkeypatch.setattr(latency, "measure_copy_bandwidth", lambda *args, **kwargs: 1e9)
    path = tmp_path / "bench.json"
    code = main(["bench", "latency", *TINY, *flags, "--output-json", str(path)])
    return code, json.loads(path.read_text())


def test_bench_latency_on_cpu_says_the_breakdown_was_not_measured(tmp_path, monkeypatch, capsys):
    code, payload = _bench(tmp_path, monkeypatch, "--output-len", "3")
    assert code == 0
    (row,) = payload["results"]
    assert row["kernel_breakdown"] == {
        "measured": False,
        "note": "n/a: platform cpu traces no device activity",
    }
    assert "--kernel-breakdown" in payload["command"]
    out = capsys.readouterr().out
    assert "kernel breakdown, per decode step" in out
    assert "eager                n/a: platform cpu traces no device activity" in out
    assert "llama-tiny" not in format_budget_table([payload])  # nothing measured, no row


def test_bench_latency_breakdown_through_the_engine(
    tmp_path, monkeypatch, capsys, cpu_ops_as_device_work
):
    code, payload = _bench(tmp_path, monkeypatch, "--output-len", "8")
    assert code == 0
    (row,) = payload["results"]
    breakdown = row["kernel_breakdown"]
    assert breakdown["measured"] and breakdown["num_layers"] == 2
    assert breakdown["kernels_per_layer"] == pytest.approx(breakdown["kernels_per_step"] / 2)
    assert breakdown["gaps"]["sum_us_per_step"] is not None  # the engine annotated its steps
    assert len(breakdown["top_kernels"]) == 10
    printed = format_kernel_breakdown(payload["results"])
    assert printed in capsys.readouterr().out
    table = format_budget_table([payload]).splitlines()
    assert table[0].startswith("| model | mode | batch | step ms | device-busy ms | floor ms |")
    cells = table[2].split(" | ")
    assert cells[:3] == ["| llama-tiny", "eager", "1"]
    assert cells[6] == f"{breakdown['kernels_per_step']:.0f}"
    assert cells[7] == f"{breakdown['kernels_per_layer']:.1f}"
