"""``/metrics``' per-token series, counted in plain Python: the time-per-output-token histogram
exports the same buckets, count and sum as prometheus_client's ``Histogram`` observed once per
token, and the generated-token counter, added up per take, counts each token once however often
it is scraped.

Run: ``pytest tests/entrypoints/test_serve_token_metrics.py -q``
"""

from __future__ import annotations

import pytest

pytest.importorskip("prometheus_client")

from prometheus_client import CollectorRegistry, Histogram, generate_latest  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from pieceworks.engine.messages import EngineStats  # noqa: E402
from pieceworks.entrypoints.serve.metrics import _TPOT_BUCKETS, ServerMetrics  # noqa: E402

NAME = "pieceworks:time_per_output_token_seconds"
# (seconds since the previous delta, tokens in the delta): bounds hit exactly, past the last
# bound, several tokens sharing one gap
GAPS = [(0.0005, 1), (0.003, 3), (0.01, 1), (0.02, 4), (7.0, 1), (0.0001, 2)]


def histogram_samples(text: str) -> dict[tuple[str, str], float]:
    """(sample name, its ``le``) -> value of the TPOT histogram's samples, ``_created`` left out."""
    family = next(f for f in text_string_to_metric_families(text) if f.name == NAME)
    return {
        (s.name, s.labels.get("le", "")): s.value
        for s in family.samples
        if not s.name.endswith("_created")
    }


def test_token_gaps_export_as_a_per_token_histogram():
    metrics = ServerMetrics("m")
    registry = CollectorRegistry()
    reference = Histogram(NAME, "h", ["model_name"], buckets=_TPOT_BUCKETS, registry=registry)
    for seconds, num_tokens in GAPS:
        metrics.observe_token_gap(seconds, num_tokens)
        for _ in range(num_tokens):
            reference.labels("m").observe(seconds / num_tokens)
    ours = histogram_samples(metrics.render(EngineStats()).decode())
    theirs = histogram_samples(generate_latest(registry).decode())
    assert ours.keys() == theirs.keys()
    assert all(ours[key] == pytest.approx(theirs[key]) for key in theirs)
    assert ours[(NAME + "_count", "")] == sum(n for _, n in GAPS)


def test_generated_tokens_count_once_per_token():
    metrics = ServerMetrics("m")

    def generated() -> float:
        text = metrics.render(EngineStats()).decode()
        prefix = "pieceworks:generation_tokens_total{"
        line = next(x for x in text.splitlines() if x.startswith(prefix))
        return float(line.rsplit(" ", 1)[1])

    assert generated() == 0  # exported from the start
    metrics.add_generated_tokens(3)
    metrics.add_generated_tokens(0)
    metrics.add_generated_tokens(2)
    assert generated() == 5
    assert generated() == 5  # a second scrape adds nothing
    metrics.add_generated_tokens(1)
    assert generated() == 6
