"""The scheduling policies order the waiting queue and choose the preemption victim.

Proves: the fcfs queue admits in arrival order and puts a preempted request back at the front;
the priority queue admits the lowest priority value first, ties by arrival, and puts a preempted
request back at its own place; both drop an aborted request from the queue; under memory pressure
fcfs preempts the most recently admitted running request and priority the lowest-priority one
(largest value, latest arrival), even one admitted before the request that needs the blocks; a
later higher-priority request is served ahead of those running, the batch still listing decodes
first; the random workloads of ``test_scheduler.py`` give the reference tokens under the priority
policy with random priorities; an unknown policy name is refused naming the field and the choices,
and a non-zero priority under fcfs is refused naming both ways out.
Run: pytest tests/scheduler/test_policy.py
"""

from __future__ import annotations

import random

import pytest

from pieceworks.config import SCHEDULING_POLICIES, CacheConfig, SchedulerConfig
from pieceworks.sampling_params import SamplingParams
from pieceworks.scheduler.policy import (
    POLICIES,
    FCFSRequestQueue,
    PriorityRequestQueue,
    make_scheduling_policy,
)
from pieceworks.scheduler.request import Request, RequestStatus
from pieceworks.scheduler.scheduler import Scheduler
from tests.scheduler.test_scheduler import (
    check_matches_reference,
    random_requests,
    run_to_completion,
)

PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def make_request(name: str, priority: int = 0, arrival_time: float = 0.0) -> Request:
    return Request(name, [1, 2, 3, 4], PARAMS, priority=priority, arrival_time=arrival_time)


def make_scheduler(policy: str, num_blocks: int = 256, async_scheduling=False) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, policy=policy),
        CacheConfig(block_size=4),
        max_model_len=256,
        num_blocks=num_blocks,
        async_scheduling=async_scheduling,
    )


def names(queue) -> list[str]:
    return [request.request_id for request in queue]


def test_fcfs_queue_admits_in_arrival_order_and_a_preempted_request_first():
    queue = FCFSRequestQueue()
    first, second, third = make_request("a", 5), make_request("b", 0), make_request("c", 1)
    for request in (first, second, third):
        queue.add_request(request)
    assert names(queue) == ["a", "b", "c"] and len(queue) == 3
    assert queue.pop_request() is first and queue.peek_request() is second
    queue.prepend_request(first)
    assert names(queue) == ["a", "b", "c"]
    queue.remove_request(second)
    assert names(queue) == ["a", "c"]
    queue.pop_request(), queue.pop_request()
    assert not queue and len(queue) == 0


def test_priority_queue_admits_lowest_value_first_ties_by_arrival():
    queue = PriorityRequestQueue()
    late_high = make_request("late-high", priority=0, arrival_time=3.0)
    early_low = make_request("early-low", priority=2, arrival_time=1.0)
    early_high = make_request("early-high", priority=0, arrival_time=2.0)
    same_time = make_request("same-time", priority=0, arrival_time=3.0)  # ties: insertion order
    for request in (late_high, early_low, early_high, same_time):
        queue.add_request(request)
    assert names(queue) == ["early-high", "late-high", "same-time", "early-low"]
    assert queue.peek_request() is early_high and queue.pop_request() is early_high
    queue.remove_request(late_high)
    assert names(queue) == ["same-time", "early-low"] and len(queue) == 2
    # A preempted request re-enters at its own place, not at the front.
    preempted = make_request("preempted", priority=3, arrival_time=0.0)
    queue.prepend_request(preempted)
    assert names(queue) == ["same-time", "early-low", "preempted"]
    assert [queue.pop_request() for _ in range(3)] == [same_time, early_low, preempted]
    assert not queue


def test_an_aborted_request_leaves_the_waiting_queue_of_either_policy():
    for policy in SCHEDULING_POLICIES:
        scheduler = make_scheduler(policy)
        kept, aborted = make_request("kept", arrival_time=1.0), make_request("gone")
        scheduler.add_request(kept)
        scheduler.add_request(aborted)
        assert scheduler.finish_requests(["gone"], RequestStatus.FINISHED_ABORTED) == [aborted]
        assert names(scheduler.waiting) == ["kept"]
        assert scheduler.schedule().scheduled_requests[0].request is kept


def first_step(scheduler: Scheduler, requests: list[Request]) -> None:
    """Admit every request (one block of 4 prompt tokens each) and give each its first token."""
    for request in requests:
        scheduler.add_request(request)
    output = scheduler.schedule()
    assert output.num_requests == len(requests)
    scheduler.update_from_output(output, [5] * len(requests))


@pytest.mark.parametrize(
    ("policy", "priorities", "victim"),
    [
        ("fcfs", (0, 0, 0), "c"),  # the most recently admitted
        ("priority", (0, 5, 1), "b"),  # the largest priority value
        ("priority", (5, 0, 0), "a"),  # the lowest priority, though admitted first
        ("priority", (1, 1, 1), "c"),  # a tie: the latest arrival
    ],
)
def test_memory_pressure_preempts_the_policys_victim(policy, priorities, victim):
    # 4 blocks of 4 tokens: three 4-token prompts take 3; each decode then needs a second block,
    # so the one free block goes to the first request served and one request must give way.
    scheduler = make_scheduler(policy, num_blocks=4)
    requests = [
        make_request(name, priority, arrival_time=float(index))
        for index, (name, priority) in enumerate(zip("abc", priorities))
    ]
    first_step(scheduler, requests)
    output = scheduler.schedule()
    assert [request.request_id for request in output.preempted_requests] == [victim]
    scheduled = {item.request.request_id for item in output.scheduled_requests}
    assert scheduled == set("abc") - {victim}
    assert names(scheduler.waiting) == [victim]


def test_a_later_higher_priority_prefill_is_served_first_and_decodes_still_lead():
    scheduler = make_scheduler("priority")
    decoding = make_request("decoding", priority=1)
    first_step(scheduler, [decoding])
    # Its first block differs from the decoding request's: no prefix-cache hit shortens it.
    urgent = Request("urgent", list(range(5, 105)), PARAMS, priority=0, arrival_time=1.0)
    scheduler.add_request(urgent)
    output = scheduler.schedule()  # the decode, then 63 of the 100 prompt tokens
    assert [(item.request, item.num_new_tokens) for item in output.scheduled_requests] == [
        (decoding, 1),
        (urgent, 63),
    ]
    assert scheduler.running == [urgent, decoding]  # service order from now on
    scheduler.update_from_output(output, [5])
    output = scheduler.schedule()  # served in that order, listed decode first
    assert [(item.request, item.num_new_tokens) for item in output.scheduled_requests] == [
        (decoding, 1),
        (urgent, 37),
    ]


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("seed", range(2))
def test_random_workloads_under_the_priority_policy_give_the_reference_tokens(
    seed, async_scheduling
):
    requests = random_requests(seed, num_requests=24)
    rng = random.Random(seed)
    for request in requests:
        request.priority = rng.randrange(4)
    scheduler = make_scheduler("priority", num_blocks=24, async_scheduling=async_scheduling)
    outputs = run_to_completion(scheduler, requests)
    assert any(output.preempted_requests for output in outputs), "the pool must be too small"
    check_matches_reference(requests)


def test_the_factory_knows_every_configured_policy_and_refuses_others():
    assert tuple(POLICIES) == SCHEDULING_POLICIES
    built = [make_scheduling_policy(name).name for name in SCHEDULING_POLICIES]
    assert built == ["fcfs", "priority"]
    message = (
        "SchedulerConfig.policy='lottery' is not a scheduling policy; choose one of "
        "['fcfs', 'priority'] (--scheduling-policy)"
    )
    with pytest.raises(ValueError) as error:
        make_scheduling_policy("lottery")
    assert str(error.value) == message
    with pytest.raises(ValueError) as error:
        SchedulerConfig(policy="lottery")
    assert str(error.value) == message


def test_a_priority_under_fcfs_is_refused_before_anything_is_queued():
    scheduler = make_scheduler("fcfs")
    with pytest.raises(ValueError) as error:
        scheduler.add_request(make_request("urgent", priority=-1))
    assert str(error.value) == (
        "request 'urgent' has priority=-1, but priority scheduling is not enabled "
        "(scheduling_policy='fcfs'); pass scheduling_policy='priority' or leave priority at 0"
    )
    assert not scheduler.waiting and not scheduler.requests
    make_scheduler("priority").add_request(make_request("urgent", priority=-1))
