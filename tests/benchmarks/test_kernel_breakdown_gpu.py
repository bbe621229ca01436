"""On a GPU, ``bench latency --kernel-breakdown`` attributes every kernel of a FULL_AND_PIECEWISE
decode step to its step call: the CUDA graph's kernels by their launch's correlation id (the
profile's CPU activity records the launches and the step annotations), so the holes are split
into inside and between steps, and the counts are those of a real step.

Run on a GPU machine: pytest -m gpu tests/benchmarks/test_kernel_breakdown_gpu.py
"""

from __future__ import annotations

import json

import pytest

from pieceworks.entrypoints.cli import main


@pytest.mark.gpu
def test_graph_kernels_belong_to_their_step(tmp_path):
    path = tmp_path / "bench.json"
    flags = ["--model", "llama-tiny", "--batch-size", "4", "--input-len", "8", "--output-len",
             "32", "--num-iters-warmup", "1", "--num-iters", "1", "--modes", "full_and_piecewise",
             "--compilation-config", '{"backend": "eager"}', "--kernel-breakdown"]  # fmt: skip
    assert main(["bench", "latency", *flags, "--output-json", str(path)]) == 0
    (row,) = json.loads(path.read_text())["results"]
    breakdown = row["kernel_breakdown"]
    assert breakdown["measured"] and breakdown["note"] is None, breakdown
    assert breakdown["num_outside_steps"] == 0, breakdown
    # at least a projection and attention per layer of the 2-layer model
    assert breakdown["kernels_per_step"] >= 2 * breakdown["num_layers"]
    assert breakdown["device_busy_ms"] == pytest.approx(row["device_busy_ms"])
    assert breakdown["kernel_ms_per_step"] >= breakdown["device_busy_ms"] * 0.999
    gaps = breakdown["gaps"]
    assert gaps["sum_us_per_step"] >= 0 and gaps["between_steps_us_per_step"] >= 0
    assert breakdown["top_kernels"][0]["share"] > 0
