"""``ServerMetrics``: the server's Prometheus metrics, in a registry of its own.

Names follow vLLM's ``vllm:`` metrics under a ``pieceworks:`` prefix: running and waiting
requests, KV-cache usage and the steps that held a structured-output request (gauges read from
the engine loop's ``EngineStats`` at scrape time), time to first token and time per output token
(histograms, seconds; the latter, observed per streamed token, counted by ``TokenGapHistogram``),
each request's queue and prefill time in the engine (histograms the engine counts, exported from
its stats by ``EngineHistogram``), generated and prompt tokens and finished requests by finish
reason (counters), the prefix cache's queried and hit tokens and, with speculative decoding, the
verified and accepted proposals (``spec_decode_*``) (counters advanced to the engine's cumulative
counts at scrape time). What is observed per request or per token is added up in plain Python and
pushed into the Prometheus objects at scrape time. One registry per server, so several servers in
one process (tests) never share counts.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from pieceworks.engine.messages import EngineStats
from pieceworks.scheduler.request_timing import PHASE_BUCKETS_S, PhaseSnapshot

_TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
_TPOT_BUCKETS = (
    0.0005,
    0.001,
    0.002,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
)

# First-token times kept between scrapes before they go into the histogram anyway.
_MAX_PENDING_OBSERVATIONS = 4096

# (EngineStats field, counter name, help): speculative decoding, as vLLM names them.
_SPEC_COUNTERS = (
    ("spec_num_drafts", "num_drafts", "Requests verified with proposals"),
    ("spec_num_draft_tokens", "num_draft_tokens", "Proposed tokens verified"),
    ("spec_num_accepted_tokens", "num_accepted_tokens", "Proposed tokens accepted"),
)


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        self.running = Gauge(
            "pieceworks:num_requests_running",
            "Requests in the running batch",
            labels,
            registry=self.registry,
        )
        self.waiting = Gauge(
            "pieceworks:num_requests_waiting",
            "Requests queued for the engine",
            labels,
            registry=self.registry,
        )
        self.kv_usage = Gauge(
            "pieceworks:kv_cache_usage_perc",
            "Share of KV-cache blocks in use (0 to 1)",
            labels,
            registry=self.registry,
        )
        self.ttft = Histogram(
            "pieceworks:time_to_first_token_seconds",
            "Arrival to first generated token",
            labels,
            buckets=_TTFT_BUCKETS,
            registry=self.registry,
        )
        self.tpot = TokenGapHistogram(
            "pieceworks:time_per_output_token_seconds",
            "Gap between a choice's tokens",
            _TPOT_BUCKETS,
            model_name,
        )
        self.registry.register(self.tpot)
        # vLLM's request_queue_time / request_prefill_time, from the engine's stats
        self.queue_time = EngineHistogram(
            "pieceworks:request_queue_time_seconds",
            "Arrival in the engine to first scheduled",
            model_name,
        )
        self.prefill_time = EngineHistogram(
            "pieceworks:request_prefill_time_seconds",
            "First scheduled to first generated token, in the engine",
            model_name,
        )
        self.registry.register(self.queue_time)
        self.registry.register(self.prefill_time)
        # (seconds, num_tokens): a delta of ``num_tokens`` tokens arrived ``seconds`` after the
        # previous one, each token counting as ``seconds / num_tokens``
        self.observe_token_gap = self.tpot.observe
        self.generation_tokens = Counter(
            "pieceworks:generation_tokens", "Tokens generated", labels, registry=self.registry
        )
        self.prompt_tokens = Counter(
            "pieceworks:prompt_tokens", "Prompt tokens accepted", labels, registry=self.registry
        )
        self.finished = Counter(
            "pieceworks:request_success",
            "Requests finished, by finish reason",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )
        # vLLM's speculative decoding counters; totals from the engine's stats at each render.
        self.spec_counters = {
            field: Counter(f"pieceworks:spec_decode_{name}", text, labels, registry=self.registry)
            for field, name, text in _SPEC_COUNTERS
        }
        self._spec_totals = dict.fromkeys(self.spec_counters, 0)
        self.constrained_steps = Gauge(
            "pieceworks:structured_output_steps",
            "Engine steps whose batch held a structured-output request: one step per round "
            "trip, masked in the masked decode tail or before the host sampler",
            labels,
            registry=self.registry,
        )
        self.prefix_cache_queries = Counter(
            "pieceworks:prefix_cache_queries",
            "Tokens of admitted requests looked up in the prefix cache",
            labels,
            registry=self.registry,
        )
        self.prefix_cache_hits = Counter(
            "pieceworks:prefix_cache_hits",
            "Tokens of admitted requests found in the prefix cache",
            labels,
            registry=self.registry,
        )
        for metric in (  # exported from the start (at 0), as a scraper expects, not first when used
            self.ttft,
            self.generation_tokens,
            self.prompt_tokens,
            self.prefix_cache_queries,
            self.prefix_cache_hits,
        ):
            metric.labels(model_name)
        self._prefix_cache_seen = (0, 0)  # the engine's counts at the last scrape
        self.model_name = model_name
        self._prompt_tokens = self.prompt_tokens.labels(model_name)
        self._generation_tokens = self.generation_tokens.labels(model_name)
        # Per request and per token the server adds up plain Python numbers, pushed into the
        # Prometheus objects when ``/metrics`` is scraped (``render``): each ``inc`` and
        # ``observe`` of prometheus_client takes a lock and checks its argument.
        self._ttft = self.ttft.labels(model_name)
        # Each observed since the last push, then zero again.
        self._first_token_seconds: list[float] = []
        self.num_prompt_tokens = 0
        self.num_finished: dict[str, int] = {}  # finish reason -> requests
        # Tokens streamed, added up per take (``add_generated_tokens``, or the attribute itself
        # on the per-token path).
        self.num_generated_tokens = 0

    def observe_first_token(self, seconds: float) -> None:
        pending = self._first_token_seconds
        pending.append(seconds)
        if len(pending) >= _MAX_PENDING_OBSERVATIONS:  # a server nobody scrapes stays bounded
            self._push_first_tokens()

    def add_generated_tokens(self, num_tokens: int) -> None:
        self.num_generated_tokens += num_tokens

    def add_request(self, num_prompt_tokens: int) -> None:
        self.num_prompt_tokens += num_prompt_tokens

    def add_finished(self, finish_reason: str) -> None:
        num_finished = self.num_finished
        num_finished[finish_reason] = num_finished.get(finish_reason, 0) + 1

    def _push_first_tokens(self) -> None:
        pending, self._first_token_seconds = self._first_token_seconds, []
        for seconds in pending:
            self._ttft.observe(seconds)

    def _push_counts(self) -> None:
        """Add the plain counts to their counters and start them again from zero."""
        self._push_first_tokens()
        if self.num_prompt_tokens:
            self._prompt_tokens.inc(self.num_prompt_tokens)
            self.num_prompt_tokens = 0
        for reason, count in self.num_finished.items():
            self.finished.labels(self.model_name, reason).inc(count)
        self.num_finished = {}
        if self.num_generated_tokens:
            self._generation_tokens.inc(self.num_generated_tokens)
            self.num_generated_tokens = 0

    def render(self, stats: EngineStats) -> bytes:
        """The Prometheus text exposition, with the gauges set from ``stats``."""
        self.running.labels(self.model_name).set(stats.num_running)
        self.waiting.labels(self.model_name).set(stats.num_waiting)
        self.kv_usage.labels(self.model_name).set(stats.kv_cache_usage)
        for field, counter in self.spec_counters.items():
            total = getattr(stats, field)
            if total > self._spec_totals[field]:
                counter.labels(self.model_name).inc(total - self._spec_totals[field])
                self._spec_totals[field] = total
        self.constrained_steps.labels(self.model_name).set(stats.num_constrained_steps)
        queries, hits = stats.prefix_cache_queries, stats.prefix_cache_hits
        seen_queries, seen_hits = self._prefix_cache_seen
        if queries > seen_queries:
            self.prefix_cache_queries.labels(self.model_name).inc(queries - seen_queries)
        if hits > seen_hits:
            self.prefix_cache_hits.labels(self.model_name).inc(hits - seen_hits)
        self._prefix_cache_seen = (max(queries, seen_queries), max(hits, seen_hits))
        if stats.request_queue_time is not None:
            self.queue_time.snapshot = stats.request_queue_time
        if stats.request_prefill_time is not None:
            self.prefill_time.snapshot = stats.request_prefill_time
        self._push_counts()
        return generate_latest(self.registry)


class TokenGapHistogram(Collector):
    """A histogram of the gaps between a choice's tokens, counted in plain Python and exported
    as a Prometheus histogram (``_bucket``, ``_count``, ``_sum``) at scrape time.

    It is observed once per delta of every stream, so per streamed token at many streams:
    ``observe`` is one bisection and two additions, where prometheus_client's ``Histogram``
    takes a lock and walks its buckets once per token."""

    def __init__(
        self, name: str, documentation: str, buckets: tuple[float, ...], model_name: str
    ) -> None:
        self.name, self.documentation, self.model_name = name, documentation, model_name
        self.upper_bounds = buckets
        self.counts = [0] * (len(buckets) + 1)  # per bucket, not cumulative; the last is +Inf
        self.sum = 0.0

    def observe(self, seconds: float, num_tokens: int) -> None:
        """``num_tokens`` gaps of ``seconds / num_tokens`` each (a bucket's bound is <=)."""
        if num_tokens > 0:
            self.counts[bisect.bisect_left(self.upper_bounds, seconds / num_tokens)] += num_tokens
            self.sum += seconds

    def describe(self) -> list[Metric]:
        return [HistogramMetricFamily(self.name, self.documentation, labels=["model_name"])]

    def collect(self) -> list[Metric]:
        return [_histogram(self, self.upper_bounds, self.counts, self.sum)]


class EngineHistogram(Collector):
    """A histogram the engine counts (``PhaseSnapshot``: its request queue and prefill times),
    exported as a Prometheus histogram from the latest stats; zero until the engine's first."""

    def __init__(self, name: str, documentation: str, model_name: str) -> None:
        self.name, self.documentation, self.model_name = name, documentation, model_name
        self.snapshot = PhaseSnapshot((0,) * (len(PHASE_BUCKETS_S) + 1), 0.0)

    def describe(self) -> list[Metric]:
        return [HistogramMetricFamily(self.name, self.documentation, labels=["model_name"])]

    def collect(self) -> list[Metric]:
        snapshot = self.snapshot
        return [_histogram(self, PHASE_BUCKETS_S, snapshot.counts, snapshot.sum_s)]


def _histogram(
    metric: TokenGapHistogram | EngineHistogram,
    upper_bounds: tuple[float, ...],
    counts: Sequence[int],
    total: float,
) -> HistogramMetricFamily:
    """``metric``'s family from per-bucket counts (the last one +Inf) and their sum."""
    family = HistogramMetricFamily(metric.name, metric.documentation, labels=["model_name"])
    bounds = [floatToGoString(bound) for bound in upper_bounds] + ["+Inf"]
    family.add_metric([metric.model_name], list(zip(bounds, itertools.accumulate(counts))), total)
    return family
