"""The scheduler's request timing: each request's engine queue time (arrival to first scheduled)
and prefill time (first scheduled to first token) are observed once, on the engine's clock.

Proves: with a clock the test sets, a request waiting behind another counts the seconds until
it is first scheduled and the seconds until its first token lands, in the right buckets;
preempted requests and chunked prefills count once, from their first scheduling (random
workloads with a tiny block pool); a request aborted before its first token counts in the queue
only; the engine's stats carry both histograms.

Run: ``pytest tests/scheduler/test_request_timing.py -q``
"""

from __future__ import annotations

from pieceworks.sampling_params import SamplingParams
from pieceworks.scheduler import request_timing
from pieceworks.scheduler.request import Request, RequestStatus
from pieceworks.scheduler.request_timing import PHASE_BUCKETS_S
from tests.scheduler.test_scheduler import (
    EOS_TOKEN_ID,
    make_scheduler,
    random_requests,
    run_to_completion,
)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def bucket(seconds: float) -> int:
    return next(i for i, bound in enumerate(PHASE_BUCKETS_S) if seconds <= bound)


def test_queue_and_prefill_times_on_a_set_clock(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(request_timing.time, "monotonic", clock)
    scheduler = make_scheduler(max_num_seqs=1, max_num_batched_tokens=4)
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    first = Request("a", [1, 2, 3], params, eos_token_id=EOS_TOKEN_ID, arrival_time=100.0)
    second = Request("b", [4, 5, 6, 7, 8, 9], params, eos_token_id=EOS_TOKEN_ID, arrival_time=100.0)
    scheduler.add_request(first)
    scheduler.add_request(second)
    clock.now = 100.002  # "a" scheduled 2 ms after arriving; "b" waits for its seat
    output = scheduler.schedule()
    assert [s.request for s in output.scheduled_requests] == [first]
    clock.now = 100.010
    scheduler.update_from_output(output, [11])  # "a"'s first token: prefill 8 ms
    clock.now = 100.011
    output = scheduler.schedule()
    clock.now = 100.012
    assert scheduler.update_from_output(output, [12]) == [first]  # max_tokens: "a" ends
    clock.now = 100.5  # "b" scheduled 0.5 s after arriving, its 6 tokens in two chunks of 4
    output = scheduler.schedule()
    clock.now = 100.6
    scheduler.update_from_output(output, [])
    output = scheduler.schedule()
    clock.now = 100.75
    scheduler.update_from_output(output, [13])  # prefill 0.25 s
    queue, prefill = scheduler.timing.queue.snapshot(), scheduler.timing.prefill.snapshot()
    assert queue.count == 2 and abs(queue.sum_s - 0.502) < 1e-9
    assert queue.counts[bucket(0.002)] == 1 and queue.counts[bucket(0.5)] == 1
    assert prefill.count == 2 and abs(prefill.sum_s - 0.258) < 1e-9
    assert prefill.counts[bucket(0.008)] == 1 and prefill.counts[bucket(0.25)] == 1


def test_a_request_aborted_before_its_first_token_counts_in_the_queue_only():
    scheduler = make_scheduler(max_num_seqs=1, max_num_batched_tokens=4)
    params = SamplingParams(temperature=0.0, max_tokens=4)
    request = Request("a", list(range(1, 10)), params, eos_token_id=EOS_TOKEN_ID)
    scheduler.add_request(request)
    output = scheduler.schedule()  # the first of three chunks
    scheduler.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    scheduler.update_from_output(output, [])
    assert scheduler.timing.queue.snapshot().count == 1
    assert scheduler.timing.prefill.snapshot().count == 0


def test_preempted_and_chunked_requests_count_once():
    requests = random_requests(3, num_requests=16, max_prompt_len=15, max_tokens=10)
    scheduler = make_scheduler(max_num_seqs=4, num_blocks=6, max_num_batched_tokens=8)
    run_to_completion(scheduler, requests)
    assert sum(request.num_preemptions for request in requests) > 0
    assert scheduler.timing.queue.snapshot().count == len(requests)
    assert scheduler.timing.prefill.snapshot().count == len(requests)
    assert not scheduler.timing._awaiting_first_token  # nothing left behind
