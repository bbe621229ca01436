"""``/metrics`` counts per-request observations added up in plain Python between scrapes: prompt
tokens, finished requests by reason and time to first token reach their Prometheus objects at
the scrape, each counted once however often it is scraped, and a server nobody scrapes keeps
only a bounded number of first-token times before they go into the histogram. The engine's
queue and prefill time histograms are exported (at zero before its first stats) from the
engine's cumulative bucket counts, bucket by bucket.

Run: ``pytest tests/entrypoints/test_serve_request_metrics.py -q``
"""

from __future__ import annotations

from pieceworks.engine.messages import EngineStats
from pieceworks.entrypoints.serve import metrics as metrics_module
from pieceworks.entrypoints.serve.metrics import ServerMetrics
from pieceworks.scheduler.request_timing import PHASE_BUCKETS_S, PhaseSnapshot


def sample(text: str, line_start: str) -> float:
    line = next(line for line in text.splitlines() if line.startswith(line_start))
    return float(line.rsplit(" ", 1)[1])


def test_request_counts_reach_the_scrape_once():
    metrics = ServerMetrics("m")
    text = metrics.render(EngineStats()).decode()
    assert "request_success_total{" not in text  # a reason appears once a request had it
    assert sample(text, "pieceworks:prompt_tokens_total{") == 0
    for reason in ("stop", "length", "stop"):
        metrics.add_finished(reason)
    metrics.add_request(5)
    metrics.add_request(7)
    metrics.observe_first_token(0.003)  # the 0.005 bucket
    metrics.observe_first_token(0.5)
    metrics.render(EngineStats())
    text = metrics.render(EngineStats()).decode()  # a second scrape adds nothing
    assert sample(text, "pieceworks:prompt_tokens_total{") == 12
    assert sample(text, 'pieceworks:request_success_total{finished_reason="stop"') == 2
    assert sample(text, 'pieceworks:request_success_total{finished_reason="length"') == 1
    assert sample(text, "pieceworks:time_to_first_token_seconds_count{") == 2
    assert sample(text, 'pieceworks:time_to_first_token_seconds_bucket{le="0.005"') == 1
    assert sample(text, "pieceworks:time_to_first_token_seconds_sum{") == 0.503
    metrics.add_finished("stop")
    text = metrics.render(EngineStats()).decode()
    assert sample(text, 'pieceworks:request_success_total{finished_reason="stop"') == 3


def test_first_token_times_stay_bounded_without_a_scrape(monkeypatch):
    monkeypatch.setattr(metrics_module, "_MAX_PENDING_OBSERVATIONS", 3)
    metrics = ServerMetrics("m")
    for _ in range(7):
        metrics.observe_first_token(0.01)
    assert len(metrics._first_token_seconds) == 1  # two pushes of 3 each
    text = metrics.render(EngineStats()).decode()
    assert sample(text, "pieceworks:time_to_first_token_seconds_count{") == 7


def test_engine_queue_and_prefill_times_are_exported_from_its_stats():
    metrics = ServerMetrics("m")
    text = metrics.render(EngineStats()).decode()  # exported at zero before the engine's stats
    assert sample(text, "pieceworks:request_queue_time_seconds_count{") == 0
    counts = [0] * (len(PHASE_BUCKETS_S) + 1)
    counts[PHASE_BUCKETS_S.index(0.01)] = 2  # two requests queued between 5 and 10 ms
    counts[-1] = 1  # one beyond the last bound
    queue = PhaseSnapshot(tuple(counts), 100.015)
    prefill = PhaseSnapshot((1,) + (0,) * len(PHASE_BUCKETS_S), 0.0005)
    stats = EngineStats(request_queue_time=queue, request_prefill_time=prefill)
    metrics.render(stats)
    text = metrics.render(stats).decode()  # the engine's totals: a second scrape adds nothing
    assert sample(text, 'pieceworks:request_queue_time_seconds_bucket{le="0.005"') == 0
    assert sample(text, 'pieceworks:request_queue_time_seconds_bucket{le="0.01"') == 2
    assert sample(text, 'pieceworks:request_queue_time_seconds_bucket{le="+Inf"') == 3
    assert sample(text, "pieceworks:request_queue_time_seconds_count{") == 3
    assert sample(text, "pieceworks:request_queue_time_seconds_sum{") == 100.015
    assert sample(text, 'pieceworks:request_prefill_time_seconds_bucket{le="0.001"') == 1
    assert sample(text, "pieceworks:request_prefill_time_seconds_sum{") == 0.0005
