"""``bench serve``'s request sampling and summary, without a server.

Proves: random prompts have the asked lengths (fixed, or within ``range_ratio``) and ids below
``vocab_size``; a text file gives one prompt per non-empty line, cycled; the summary's throughput
is counts over duration and its TTFT, TPOT and ITL percentiles are those of the recorded times;
failed requests are counted apart with their error.
Run: pytest tests/benchmarks/test_serve_bench.py
"""

from __future__ import annotations

import pytest

from pieceworks.benchmarks.serve import RequestResult, sample_requests, summarize


def test_random_prompts_fixed_and_sampled_lengths():
    fixed = sample_requests(5, input_len=7, output_len=3, vocab_size=11)
    assert all(len(r.prompt) == 7 and r.output_len == 3 for r in fixed)
    assert all(0 <= t < 11 for r in fixed for t in r.prompt)
    sampled = sample_requests(50, input_len=10, output_len=20, range_ratio=0.5, seed=1)
    assert all(5 <= r.prompt_len <= 15 and 10 <= r.output_len <= 30 for r in sampled)
    assert len({r.prompt_len for r in sampled}) > 1
    with pytest.raises(ValueError, match="range_ratio"):
        sample_requests(1, 4, 4, range_ratio=1.0)


def test_text_file_prompts(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("first prompt here\n\nsecond one\n")
    requests = sample_requests(3, input_len=0, output_len=4, dataset_path=str(path))
    assert [r.prompt for r in requests] == ["first prompt here", "second one", "first prompt here"]
    assert [r.prompt_len for r in requests] == [3, 2, 3]


def test_summary_percentiles_and_throughput():
    results = [
        RequestResult(4, success=True, ttft_s=0.1 * i, latency_s=1.0 + 0.1 * i, output_tokens=11,
                      itl_s=[0.09] * 10)
        for i in range(1, 11)
    ] + [RequestResult(4, error="HTTP 503")]  # fmt: skip
    summary = summarize(results, duration_s=2.0)
    assert summary["completed"] == 10 and summary["failed"] == 1
    assert summary["errors"] == ["HTTP 503"]
    assert summary["request_throughput"] == pytest.approx(5.0)
    assert summary["output_token_throughput"] == pytest.approx(55.0)
    assert summary["total_token_throughput"] == pytest.approx(75.0)
    assert summary["ttft_ms"]["p50"] == pytest.approx(550.0)
    assert summary["tpot_ms"]["mean"] == pytest.approx(100.0)  # (latency - ttft) / 10 tokens
    assert summary["itl_ms"]["p99"] == pytest.approx(90.0)
