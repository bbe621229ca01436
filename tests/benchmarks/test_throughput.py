"""``bench throughput``: one timed ``generate`` over many prompts, on llama-tiny at level 0.

Proves: every prompt generates exactly its ``output_len`` tokens (ignore_eos), the token counts
add up, and the rates are the counts over the measured time.
Run: pytest tests/benchmarks/test_throughput.py
"""

from __future__ import annotations

import pytest

from pieceworks.benchmarks.throughput import measure_throughput


def test_throughput_counts_and_rates():
    result = measure_throughput(
        "llama-tiny", num_prompts=12, input_len=8, output_len=5,
        compilation_config={"level": 0}, dtype="float32", max_num_seqs=4,
    )  # fmt: skip
    assert result["total_output_tokens"] == 12 * 5
    assert result["total_input_tokens"] == 12 * 8
    elapsed = result["elapsed_s"]
    assert result["output_tokens_per_s"] == pytest.approx(60 / elapsed)
    assert result["requests_per_s"] == pytest.approx(12 / elapsed)
