"""``bench serve``'s request sampling and summary, without a server.

Proves: random prompts have the asked lengths (fixed, or within ``range_ratio``) and ids below
``vocab_size``; a text file gives one prompt per non-empty line, cycled; the summary's throughput
is counts over duration and its TTFT, TPOT and ITL percentiles are those of the recorded times;
failed requests are counted apart with their error; the shared-prefix workload shares one prefix
and the multi-turn one makes chats of the asked turns; the hit rate comes from the growth of the
server's counters (None without them) and is printed beside the latencies; `--extra-body` is merged
into every request body (a JSON object, nothing else); the load generator's CPU share is printed,
with a warning once it was busy most of the run.
Run: pytest tests/benchmarks/test_serve_bench.py
"""

from __future__ import annotations

import pytest

from pieceworks.benchmarks.serve import (
    RequestResult,
    format_summary,
    sample_requests,
    summarize,
)
from pieceworks.benchmarks.serve_workloads import (
    engine_phase_means,
    multi_turn_chats,
    prefix_cache_hit_rate,
    shared_prefix_requests,
)


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


def test_prefix_cache_workloads_and_hit_rate():
    requests = shared_prefix_requests(4, prefix_len=10, input_len=3, output_len=2, seed=1)
    assert all(r.prompt[:10] == requests[0].prompt[:10] for r in requests)
    assert len({tuple(r.prompt[10:]) for r in requests}) == 4
    assert all(r.prompt_len == len(r.prompt) == 13 and r.output_len == 2 for r in requests)
    chats = multi_turn_chats(9, num_turns=4, input_len=5, output_len=3)
    assert len(chats) == 2 and all(len(c.questions) == 4 for c in chats)
    with pytest.raises(ValueError, match="num_turns"):
        multi_turn_chats(4, num_turns=0, input_len=5, output_len=3)
    rate = prefix_cache_hit_rate((100.0, 40.0), (300.0, 190.0))
    assert rate == {"prefix_cache_queries": 200, "prefix_cache_hits": 150,
                    "prefix_cache_hit_rate": 0.75}  # fmt: skip
    assert prefix_cache_hit_rate(None, (1.0, 1.0))["prefix_cache_hit_rate"] is None
    summary = summarize([RequestResult(4, success=True, output_tokens=1)], duration_s=1.0)
    assert "Prefix cache hit rate:      75.0% (150 of 200 tokens)" in format_summary(
        {**summary, **rate}
    )
    assert "Prefix cache" not in format_summary(summary)


def test_engine_phase_means_from_the_servers_histograms():
    before = {"queue_sum": 1.0, "queue_count": 10, "prefill_sum": 2.0, "prefill_count": 10}
    after = {"queue_sum": 1.5, "queue_count": 20, "prefill_sum": 2.2, "prefill_count": 14}
    means = engine_phase_means(before, after)
    assert means == pytest.approx({"engine_queue_ms": 50.0, "engine_prefill_ms": 50.0})
    assert engine_phase_means(None, after) == {"engine_queue_ms": None, "engine_prefill_ms": None}
    idle = engine_phase_means(after, after)  # no request in the run: no mean
    assert idle == {"engine_queue_ms": None, "engine_prefill_ms": None}
    summary = summarize([RequestResult(4, success=True, output_tokens=1)], duration_s=1.0)
    text = format_summary({**summary, **means})
    assert "Engine queue / prefill (ms): mean 50.00 / 50.00" in text
    assert "Engine queue" not in format_summary({**summary, **idle})


def test_the_load_generators_cpu_share_is_printed_and_warned_about_when_high():
    summary = summarize([RequestResult(4, success=True, output_tokens=1)], duration_s=1.0)
    assert "Load generator" not in format_summary(summary)
    quiet = format_summary({**summary, "client_cpu_share": 0.25})
    assert "Load generator CPU:         25% of one core" in quiet and "warning" not in quiet
    busy = format_summary({**summary, "client_cpu_share": 0.93})
    assert "93% of one core" in busy and "warning: the load generator was busy" in busy


def test_extra_body_is_merged_into_every_request():
    import asyncio

    from pieceworks.benchmarks.serve import BenchRequest, send_request

    sent = []

    class Session:  # stands in for aiohttp's: records the body, answers nothing
        def post(self, url, json):
            sent.append((url, json))
            raise RuntimeError("not sent")

    class Recorder:
        session = Session()

        def url(self, path):
            return "http://server" + path

    extra = {"response_format": {"type": "json_object"}, "temperature": 0.5}
    with pytest.raises(RuntimeError, match="not sent"):
        asyncio.run(
            send_request(Recorder(), "m", BenchRequest([1, 2], 2, 4), RequestResult(2), True, extra)
        )
    url, body = sent[0]
    assert url == "http://server/v1/completions"
    assert body["response_format"] == {"type": "json_object"}
    assert body["temperature"] == 0.5 and body["max_tokens"] == 4  # extra wins, rest kept


def test_extra_body_must_be_a_json_object():
    import argparse

    from pieceworks.entrypoints.bench_serve import _json_object

    assert _json_object('{"a": 1}') == {"a": 1}
    for text in ("[1]", "{not json"):
        with pytest.raises(argparse.ArgumentTypeError):
            _json_object(text)
