"""Scheduling policies: the order of the waiting queue and which running request is preempted.

A ``SchedulingPolicy`` is the scheduler's one seam for ordering (vLLM's ``--scheduling-policy``):

- ``fcfs`` (the default): waiting requests are admitted in arrival order, a preempted request goes
  back to the front of the queue, and running requests are served in admission order, so the most
  recently admitted one is preempted first when KV blocks run out.
- ``priority``: each request carries ``Request.priority`` (an int, lower is scheduled first; ties
  by ``Request.arrival_time``). The waiting queue is a heap keyed by (priority, arrival) and a
  preempted request re-enters it at its place; running requests are kept in the same order, so the
  one preempted first is the lowest priority (largest value, latest arrival).

The scheduler serves ``running`` from the front and preempts from the back; a policy keeps
``running`` ordered so that a victim is never a request already served this step. Policies order
requests only: they never allocate blocks or look at token budgets (``Scheduler`` does both).
``make_scheduling_policy`` builds one from ``SchedulerConfig.policy``.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterator
from typing import ClassVar

from pieceworks.scheduler.request import Request


class RequestQueue(ABC):
    """The waiting requests in the order a policy admits them (vLLM's ``RequestQueue``)."""

    @abstractmethod
    def add_request(self, request: Request) -> None:
        """Queue a newly arrived request."""

    @abstractmethod
    def pop_request(self) -> Request:
        """Remove and return the request admitted next."""

    @abstractmethod
    def peek_request(self) -> Request:
        """The request admitted next, left in the queue."""

    @abstractmethod
    def prepend_request(self, request: Request) -> None:
        """Queue a preempted request again, ahead of whatever its policy puts it ahead of."""

    @abstractmethod
    def remove_request(self, request: Request) -> None:
        """Drop a queued request (an abort, or a finish while preempted)."""

    @abstractmethod
    def __iter__(self) -> Iterator[Request]:
        """The queued requests in admission order."""

    @abstractmethod
    def __len__(self) -> int: ...

    def __bool__(self) -> bool:
        return len(self) > 0


class FCFSRequestQueue(RequestQueue):
    """First come, first served: a deque; a preempted request goes back to the front."""

    def __init__(self) -> None:
        self._requests: deque[Request] = deque()

    def add_request(self, request: Request) -> None:
        self._requests.append(request)

    def pop_request(self) -> Request:
        return self._requests.popleft()

    def peek_request(self) -> Request:
        return self._requests[0]

    def prepend_request(self, request: Request) -> None:
        self._requests.appendleft(request)

    def remove_request(self, request: Request) -> None:
        self._requests.remove(request)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._requests)

    def __len__(self) -> int:
        return len(self._requests)


def priority_key(request: Request) -> tuple[int, float]:
    """Lower sorts first: the smaller priority value, then the earlier arrival."""
    return request.priority, request.arrival_time


class PriorityRequestQueue(RequestQueue):
    """A heap keyed by (priority, arrival); a preempted request re-enters at its own place.

    Entries carry an insertion count after the key, so equal keys keep insertion order and two
    requests are never compared themselves.
    """

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._insertions = itertools.count()

    def add_request(self, request: Request) -> None:
        heapq.heappush(self._heap, (*priority_key(request), next(self._insertions), request))

    def pop_request(self) -> Request:
        return heapq.heappop(self._heap)[-1]

    def peek_request(self) -> Request:
        return self._heap[0][-1]

    def prepend_request(self, request: Request) -> None:
        self.add_request(request)  # the key, not the moment of preemption, decides its place

    def remove_request(self, request: Request) -> None:
        self._heap = [entry for entry in self._heap if entry[-1] is not request]
        heapq.heapify(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (entry[-1] for entry in sorted(self._heap))

    def __len__(self) -> int:
        return len(self._heap)


class SchedulingPolicy(ABC):
    """How a scheduler orders its requests: a waiting queue, and the order of ``running``.

    Invariant the scheduler relies on: ``running`` is kept in service order, the request served
    first at the front, and ``pop_preemption_victim`` takes the one served last. So a victim is
    never a request already scheduled in the step that preempts it, and the front request always
    progresses.
    """

    name: ClassVar[str]
    supports_priority: ClassVar[bool] = False

    @abstractmethod
    def make_waiting_queue(self) -> RequestQueue:
        """An empty waiting queue in this policy's order."""

    @abstractmethod
    def add_running(self, running: list[Request], request: Request) -> None:
        """Insert a just-admitted request into ``running`` at its place in service order."""

    def pop_preemption_victim(self, running: list[Request]) -> Request:
        """Remove and return the running request preempted first: the one served last."""
        return running.pop()

    def verify_request(self, request: Request) -> None:
        """Raise ``ValueError`` for a request this policy cannot order (a priority under fcfs)."""
        if request.priority != 0 and not self.supports_priority:
            raise ValueError(
                f"request {request.request_id!r} has priority={request.priority}, but priority "
                f"scheduling is not enabled (scheduling_policy={self.name!r}); pass "
                "scheduling_policy='priority' or leave priority at 0"
            )


class FCFSPolicy(SchedulingPolicy):
    """First come, first served; the most recently admitted running request is preempted first."""

    name = "fcfs"

    def make_waiting_queue(self) -> RequestQueue:
        return FCFSRequestQueue()

    def add_running(self, running: list[Request], request: Request) -> None:
        running.append(request)


class PriorityPolicy(SchedulingPolicy):
    """Lowest priority value first, ties by arrival; the lowest priority is preempted first."""

    name = "priority"
    supports_priority = True

    def make_waiting_queue(self) -> RequestQueue:
        return PriorityRequestQueue()

    def add_running(self, running: list[Request], request: Request) -> None:
        # After any equal key: of two equal requests the later admitted is preempted first.
        bisect.insort_right(running, request, key=priority_key)


# Its names are ``config.SCHEDULING_POLICIES`` (the config validates against those, below us).
POLICIES: dict[str, type[SchedulingPolicy]] = {
    FCFSPolicy.name: FCFSPolicy,
    PriorityPolicy.name: PriorityPolicy,
}


def make_scheduling_policy(name: str) -> SchedulingPolicy:
    """The policy ``SchedulerConfig.policy`` names; an unknown name is a ``ValueError``."""
    policy_cls = POLICIES.get(name)
    if policy_cls is None:
        raise ValueError(
            f"SchedulerConfig.policy={name!r} is not a scheduling policy; choose one of "
            f"{sorted(POLICIES)} (--scheduling-policy)"
        )
    return policy_cls()
