"""``RequestTiming``: how long requests wait in the engine's queue and how long their prefill takes.

vLLM's ``request_queue_time_seconds`` (arrival in the engine to first scheduled) and
``request_prefill_time_seconds`` (first scheduled to first generated token), on the engine's
clock (``time.monotonic``), so that a server's time to first token splits into the engine's
queue, its prefill and the rest (the front end's parsing, the hand-overs, the stream). A
request preempted and scheduled again counts once, from its first scheduling; one aborted
before its first token counts in the queue time only. Each phase is a histogram of cumulative
bucket counts the engine publishes in its stats and the server exports (``/metrics``).
"""

from __future__ import annotations

import bisect
import dataclasses
import time

from pieceworks.scheduler.request import Request

# Upper bounds in seconds (a bucket's bound is <=; one more bucket for +Inf): the server's
# time-to-first-token buckets, so the three histograms line up.
PHASE_BUCKETS_S = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class PhaseSnapshot:
    """A phase's histogram: requests per bucket (not cumulative; the last is +Inf) and the sum
    of their seconds."""

    counts: tuple[int, ...]
    sum_s: float

    @property
    def count(self) -> int:
        return sum(self.counts)


class PhaseHistogram:
    """One phase's observations, counted per bucket of ``PHASE_BUCKETS_S``."""

    def __init__(self) -> None:
        self.counts = [0] * (len(PHASE_BUCKETS_S) + 1)
        self.sum_s = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(PHASE_BUCKETS_S, seconds)] += 1
        self.sum_s += seconds

    def snapshot(self) -> PhaseSnapshot:
        return PhaseSnapshot(tuple(self.counts), self.sum_s)


class RequestTiming:
    """The scheduler's record of its requests' queue and prefill times."""

    def __init__(self) -> None:
        self.queue = PhaseHistogram()
        self.prefill = PhaseHistogram()
        # Scheduled, no token yet: request -> when it was first scheduled.
        self._awaiting_first_token: dict[Request, float] = {}

    def scheduled(self, request: Request) -> None:
        """``request`` was admitted to the running batch (counted the first time only)."""
        if request.num_preemptions or request in self._awaiting_first_token:
            return  # preempted: its queue time was counted when it was first scheduled
        now = time.monotonic()
        self.queue.observe(now - request.arrival_time)
        self._awaiting_first_token[request] = now

    def tokens_arrived(self) -> None:
        """A step's tokens were applied: the requests that got their first one end their
        prefill; those finished without one (aborted) are dropped."""
        awaiting = self._awaiting_first_token
        if not awaiting:
            return
        now = time.monotonic()
        for request in [r for r in awaiting if r.output_token_ids or r.is_finished]:
            scheduled_at = awaiting.pop(request)
            if request.output_token_ids:
                self.prefill.observe(now - scheduled_at)
