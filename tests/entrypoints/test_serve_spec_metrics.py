"""``/metrics`` counts speculative decoding: proposals verified and accepted, from the engine's
stats totals, each counted once however often it is scraped.

Run: ``pytest tests/entrypoints/test_serve_spec_metrics.py -q``
"""

from __future__ import annotations

from pieceworks.engine.messages import EngineStats
from pieceworks.entrypoints.serve.metrics import ServerMetrics


def sample(text: str, name: str) -> float:
    line = next(line for line in text.splitlines() if line.startswith(name + "{"))
    return float(line.rsplit(" ", 1)[1])


def test_spec_decode_counters_follow_the_stats_totals():
    metrics = ServerMetrics("m")
    stats = EngineStats(spec_num_drafts=2, spec_num_draft_tokens=6, spec_num_accepted_tokens=4)
    metrics.render(stats)
    text = metrics.render(stats).decode()  # a second scrape of the same totals adds nothing
    assert sample(text, "pieceworks:spec_decode_num_draft_tokens_total") == 6
    assert sample(text, "pieceworks:spec_decode_num_accepted_tokens_total") == 4
    later = EngineStats(spec_num_drafts=3, spec_num_draft_tokens=9, spec_num_accepted_tokens=4)
    text = metrics.render(later).decode()
    assert sample(text, "pieceworks:spec_decode_num_drafts_total") == 3
    assert sample(text, "pieceworks:spec_decode_num_draft_tokens_total") == 9
