"""``Scheduler``: continuous batching of prefills and decodes under a per-step token budget.

vLLM v1's shape: there are no separate prefill and decode phases. Each step every request asks to
compute its uncomputed tokens (``Request.num_uncomputed_tokens``: the whole prompt for a new
request, one token for a decoding one); running requests are served first in admission order, then
waiting ones first-come first-served, until ``max_num_batched_tokens`` or ``max_num_seqs`` is
reached. A prompt longer than the budget left is cut into chunks over several steps (chunked
prefill). When KV blocks run out, the most recently admitted running request is preempted by
recompute. The scheduler owns the request queues, the ``BlockManager`` and the
``StateSlotManager``; it never touches tensors (the model runner turns a ``SchedulerOutput`` into
input buffers) and never samples (the ``Sampler`` does; ``update_from_output`` takes its tokens).

One step is ``output = schedule()``, run the model, ``update_from_output(output, sampled)``.
``schedule()`` advances the scheduled requests' ``num_computed_tokens`` and counts the token each
will sample as a placeholder (``Request.num_output_placeholders``); the update replaces it with the
real token and checks the stop conditions. With ``async_scheduling`` one step may be scheduled
before the previous one's tokens arrive (the engine launches step N+1 while step N still runs on the
device): a decode whose last token is a placeholder reads it on the device (``PLACEHOLDER_TOKEN_ID``
in ``new_token_ids`` marks it), a request that will reach ``max_tokens`` with its pending token is
not scheduled again, and one that stops on a token that arrives late has its extra step's token
dropped. Without it, a second ``schedule()`` before the update is an error.

With ``num_scheduler_steps`` K > 1, a batch in which every scheduled request decodes (and none
asks for logprobs, and nobody waits for a free seat) runs as one multi-step output
(``SchedulerOutput.num_steps``): the runner runs up to K decode steps back to back on the device,
each feeding its sampled ids to the next. ``schedule()`` reserves the KV blocks of all of them,
limits the steps to the fewest tokens any request has left before ``max_tokens``, and counts K
placeholders per request; ``update_from_output`` takes K tokens per request and applies them in
step order, exactly as K single steps would, dropping the tokens after a request's stop.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections import deque
from collections.abc import Sequence
from typing import Final

from pieceworks.config import CacheConfig, SchedulerConfig
from pieceworks.scheduler.block_manager import BlockManager, StateSlotManager
from pieceworks.scheduler.request import Request, RequestStatus

# Stands in for a token sampled on the device that the host has not seen yet (async scheduling).
PLACEHOLDER_TOKEN_ID: Final = -1


@dataclasses.dataclass
class ScheduledRequest:
    """One request's work this step: compute ``num_new_tokens`` tokens from ``num_computed_tokens``.

    Everything a model runner reads is snapshotted when scheduled (the request's own counter then
    advances by ``num_new_tokens``). ``produces_token`` is True when the step reaches the end of
    the request's tokens (``num_computed_tokens + num_new_tokens == request.num_tokens``): the
    logits of its last scheduled position are sampled and the token is appended. A chunk of a
    prompt that stops short of its end produces no token. ``is_decode``: one token on top of a
    computed context, sampled (the shape a decode graph serves). ``new_token_ids`` are the token
    ids this step computes; one still on the device (async scheduling) is
    ``PLACEHOLDER_TOKEN_ID``.
    """

    request: Request
    num_new_tokens: int
    num_computed_tokens: int = dataclasses.field(init=False)
    produces_token: bool = dataclasses.field(init=False)
    is_decode: bool = dataclasses.field(init=False)
    new_token_ids: list[int] = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        request, num_new_tokens = self.request, self.num_new_tokens
        self.num_computed_tokens = computed = request.num_computed_tokens
        end = computed + num_new_tokens
        self.produces_token = end == request.num_tokens
        self.is_decode = num_new_tokens == 1 and self.produces_token and computed > 0
        self.new_token_ids = _token_ids(request, computed, end)

    def detached(self) -> ScheduledRequest:
        """A copy for another rank: the snapshot plus a request holding only what a runner reads
        (id, sampling parameters, blocks, state slot), not the whole token history."""
        detached = copy.copy(self)  # the snapshot fields as they are
        detached.request = self.request.runner_view()
        return detached


def _token_ids(request: Request, start: int, end: int) -> list[int]:
    """Token ids at positions [start, end); a token still on the device is a placeholder."""
    prompt, output = request.prompt_token_ids, request.output_token_ids
    num_prompt_tokens = len(prompt)
    # Slice the two lists separately: a decode must not copy the whole sequence each step.
    if start >= num_prompt_tokens:  # a decode: generated tokens only
        ids = output[start - num_prompt_tokens : end - num_prompt_tokens]
    else:
        ids = prompt[start:end] + output[: max(end - num_prompt_tokens, 0)]
    if len(ids) < end - start:
        ids += [PLACEHOLDER_TOKEN_ID] * (end - start - len(ids))
    return ids


@dataclasses.dataclass
class SchedulerOutput:
    """One step's batch: decodes first, then prefills (new, resumed or continuing chunks).

    ``preempted_requests`` were evicted this step (their blocks and state slots are already free);
    a runner that keeps per-request state drops it for them. With ``num_steps`` > 1 the batch is
    a uniform decode run ``num_steps`` times, positions advancing by one each time, and every
    producing request samples ``num_steps`` tokens. The counts over the batch are
    computed once, on first use: the batch never changes after ``schedule`` returns it.
    """

    scheduled_requests: list[ScheduledRequest]
    preempted_requests: list[Request] = dataclasses.field(default_factory=list)
    # Decode steps run back to back (each scheduled request a decode when > 1); every field
    # above describes the first of them.
    num_steps: int = 1

    @property
    def num_requests(self) -> int:
        return len(self.scheduled_requests)

    @functools.cached_property
    def num_scheduled_tokens(self) -> int:
        return sum(scheduled.num_new_tokens for scheduled in self.scheduled_requests)

    @functools.cached_property
    def max_query_len(self) -> int:
        """The most tokens any request computes this step (0 for an empty step)."""
        return max((scheduled.num_new_tokens for scheduled in self.scheduled_requests), default=0)

    @functools.cached_property
    def num_decodes(self) -> int:
        return sum(scheduled.is_decode for scheduled in self.scheduled_requests)

    @property
    def is_uniform_decode(self) -> bool:
        """Every scheduled request is a decode (one token each): a full decode graph can run it."""
        return bool(self.scheduled_requests) and self.num_decodes == self.num_requests

    def detached(self) -> SchedulerOutput:
        """The step as another rank's runner needs it (see ``ScheduledRequest.detached``),
        preempted requests included, as runner views."""
        return SchedulerOutput(
            [item.detached() for item in self.scheduled_requests],
            [request.runner_view() for request in self.preempted_requests],
            self.num_steps,
        )

    @functools.cached_property
    def producing_requests(self) -> list[ScheduledRequest]:
        """The scheduled requests that get a sampled token, in scheduled order."""
        return [scheduled for scheduled in self.scheduled_requests if scheduled.produces_token]


class Scheduler:
    """Token-budget scheduler with chunked prefill and recompute preemption.

    Invariants: every accepted request eventually finishes (the oldest running request is never
    preempted, and ``add_request`` rejects any request that could not run alone); blocks and state
    slots are held only by running requests and return on finish or preemption; preemption keeps
    generated tokens, so a resumed request recomputes prompt + generated tokens and continues.
    """

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        max_model_len: int,
        num_blocks: int,
        num_state_slots: int = 0,
        async_scheduling: bool = False,
    ) -> None:
        self.max_num_seqs = scheduler_config.max_num_seqs
        self.max_num_batched_tokens = scheduler_config.max_num_batched_tokens
        self.max_model_len = max_model_len
        self.block_manager = BlockManager(num_blocks, cache_config.block_size)
        # Only hybrid models (with Mamba layers) are given state slots.
        self.state_slot_manager = StateSlotManager(num_state_slots) if num_state_slots else None
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order: the last one is preempted first
        self.requests: dict[str, Request] = {}
        # Scheduled steps whose tokens have not come back yet, oldest first.
        self._pending_outputs: deque[SchedulerOutput] = deque()
        self.max_pending_outputs = 2 if async_scheduling else 1
        self.num_scheduler_steps = scheduler_config.num_scheduler_steps

    def add_request(self, request: Request) -> None:
        """Queue ``request``; raise ``ValueError`` if it could never run to completion."""
        self._verify_request(request)
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def check_request(self, request: Request) -> None:
        """Raise the ``ValueError`` that ``add_request`` would, queuing nothing."""
        self._verify_request(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def finish_requests(self, request_ids: Sequence[str], status: RequestStatus) -> list[Request]:
        """Finish the named unfinished requests now (an abort, or a stop string found in the
        text) and free their cache; return them. Unknown or finished ids are ignored. A token of
        theirs still on the device is dropped when its step comes back (``update_from_output``
        skips finished requests), and the device writes the freed blocks in stream order, before
        any later step that reuses them."""
        finished = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is not None and not request.is_finished:
                self._finish(request, status)
                finished.append(request)
        return finished

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    def schedule(self) -> SchedulerOutput:
        """Choose this step's requests and token counts; allocate their blocks and state slots."""
        if len(self._pending_outputs) >= self.max_pending_outputs:
            raise RuntimeError(
                f"schedule() called with {len(self._pending_outputs)} steps awaiting "
                "update_from_output() (the most this scheduler allows); update first"
            )
        scheduled: list[ScheduledRequest] = []
        preempted: list[Request] = []
        num_steps = self._num_decode_steps()
        token_budget = self._schedule_running(
            scheduled, preempted, self.max_num_batched_tokens, num_steps
        )
        if not preempted:  # after a preemption memory is short: admit nobody new (as vLLM)
            self._schedule_waiting(scheduled, token_budget)
        # Admission order already lists decodes first (a prompt is cut only when the budget runs
        # out, so only the last request served can be mid-prefill); the stable sort guarantees it.
        if not _decodes_lead(scheduled):
            scheduled.sort(key=lambda item: not item.is_decode)
        for item in scheduled:  # the step is launched: its KV is being computed from now on
            item.request.num_computed_tokens += item.num_new_tokens * num_steps
            item.request.num_output_placeholders += item.produces_token * num_steps
        output = SchedulerOutput(scheduled, preempted, num_steps)
        if scheduled:  # an empty step awaits no tokens
            self._pending_outputs.append(output)
        return output

    def update_from_output(
        self, scheduler_output: SchedulerOutput, sampled_token_ids: Sequence[int]
    ) -> list[Request]:
        """Advance the scheduled requests by the step's result; return those that finished.

        ``sampled_token_ids`` holds one token per request with ``produces_token``, in scheduled
        order. A list with one entry per scheduled request is accepted too (entries of requests
        that produce no token are ignored). A multi-step output takes ``num_steps`` such lists
        one after the other (step 0's tokens first); they are applied in that order, so a request
        that stops on one step's token drops the tokens of the steps after it.
        """
        if not scheduler_output.scheduled_requests:
            return []
        if not self._pending_outputs or scheduler_output is not self._pending_outputs[0]:
            raise RuntimeError(
                "update_from_output() must get the oldest scheduled output not yet updated"
            )
        tokens = _tokens_per_step(scheduler_output, sampled_token_ids)  # validate first
        self._pending_outputs.popleft()
        finished = []
        for scheduled, token_id in tokens:
            request = scheduled.request
            request.num_output_placeholders -= 1
            if request.is_finished:
                continue  # it stopped on an earlier step's token: this one is past its end
            request.output_token_ids.append(token_id)
            status = _check_stop(request, token_id)
            if status is not None:
                self._finish(request, status)
                finished.append(request)
        return finished

    def _num_decode_steps(self) -> int:
        """How many decode steps the next batch runs back to back: ``num_scheduler_steps`` when
        every running request it would serve decodes, none asks for logprobs, no waiting request
        could take a free seat, and the KV blocks of all the steps are free; fewer when a request
        has fewer tokens left before ``max_tokens``; else 1 (a step as without multi-step)."""
        num_steps = self.num_scheduler_steps
        if num_steps == 1 or (self.waiting and len(self.running) < self.max_num_seqs):
            return 1  # the waiting head is admitted now, as it would be without multi-step
        serving = [request for request in self.running if not _reaches_max_tokens(request)]
        if not serving:
            return 1  # every running request awaits its last token: nothing to run
        for request in serving:
            if request.num_uncomputed_tokens != 1 or request.num_computed_tokens == 0:
                return 1  # a prefill (or a prompt chunk) runs single-step
            if request.sampling_params.logprobs is not None:
                return 1  # logprobs are taken per single step
            num_left = request.sampling_params.max_tokens - (
                request.num_output_tokens + request.num_output_placeholders
            )
            num_steps = min(num_steps, num_left)
        if num_steps <= 1 or len(serving) > self.max_num_batched_tokens:
            return 1
        block_manager = self.block_manager
        num_blocks = sum(block_manager.blocks_needed(r, num_steps) for r in serving)
        return num_steps if num_blocks <= block_manager.num_free_blocks else 1

    def _schedule_running(
        self,
        scheduled: list[ScheduledRequest],
        preempted: list[Request],
        token_budget: int,
        num_steps: int = 1,
    ) -> int:
        """Serve running requests oldest first, preempting from the newest end when short;
        ``num_steps`` decode steps each (``_num_decode_steps`` checked their blocks are free)."""
        index, running = 0, self.running
        while index < len(running) and token_budget > 0:
            request = running[index]
            if _reaches_max_tokens(request):
                index += 1  # its pending token is its last: it finishes on the update
                continue
            num_new_tokens = min(request.num_uncomputed_tokens, token_budget)
            num_kv_tokens = num_new_tokens + num_steps - 1  # the later steps' KV, reserved ahead
            if not self._allocate_or_preempt(request, num_kv_tokens, preempted):
                break  # the request preempted itself: it was the newest left
            scheduled.append(ScheduledRequest(request, num_new_tokens))
            token_budget -= num_new_tokens
            index += 1
        return token_budget

    def _allocate_or_preempt(
        self, request: Request, num_new_tokens: int, preempted: list[Request]
    ) -> bool:
        # Victims come from the end of ``running``: always behind ``request``, so never a request
        # already scheduled this step, and never the oldest one (which therefore always progresses).
        while not self.block_manager.allocate(request, num_new_tokens):
            victim = self.running.pop()
            self._preempt(victim)
            preempted.append(victim)
            if victim is request:
                return False
        return True

    def _schedule_waiting(self, scheduled: list[ScheduledRequest], token_budget: int) -> None:
        """Admit waiting requests first-come first-served while budget, seats and memory last."""
        while self.waiting and token_budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            if request.num_output_placeholders:
                break  # preempted with a token still on the device: resume once it is known
            num_new_tokens = min(request.num_uncomputed_tokens, token_budget)
            if not self._allocate_for_admission(request, num_new_tokens):
                break  # no skipping ahead: the head of the queue waits for memory
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled.append(ScheduledRequest(request, num_new_tokens))
            token_budget -= num_new_tokens

    def _allocate_for_admission(self, request: Request, num_new_tokens: int) -> bool:
        slots = self.state_slot_manager
        if slots is not None and slots.num_free_slots == 0:
            return False
        if not self.block_manager.allocate(request, num_new_tokens):
            return False
        if slots is not None:
            slots.allocate(request)
        return True

    def _preempt(self, request: Request) -> None:
        """Recompute preemption: drop the cache, keep the tokens, go to the front of the queue."""
        self._free_cache(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.waiting.appendleft(request)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.finish(status)
        if request in self.running:
            self.running.remove(request)
        else:  # preempted while its last token was still on the device
            self.waiting.remove(request)
        self._free_cache(request)
        del self.requests[request.request_id]

    def _free_cache(self, request: Request) -> None:
        self.block_manager.free(request)
        if self.state_slot_manager is not None:
            self.state_slot_manager.free(request)

    def _verify_request(self, request: Request) -> None:
        name = f"request {request.request_id!r}"
        if request.request_id in self.requests:
            raise ValueError(f"{name} is already scheduled; give each request a unique id")
        if request.num_prompt_tokens == 0:
            raise ValueError(f"{name} has an empty prompt; pass at least one token")
        num_prompt_tokens = request.num_prompt_tokens
        max_tokens = request.sampling_params.max_tokens
        if num_prompt_tokens + max_tokens > self.max_model_len:
            raise ValueError(
                f"{name}: prompt of {num_prompt_tokens} tokens + max_tokens={max_tokens} "
                f"= {num_prompt_tokens + max_tokens} exceeds max_model_len={self.max_model_len}; "
                "shorten the prompt, lower max_tokens, or raise max_model_len"
            )
        # The last generated token is never fed back, so its KV is never stored.
        num_kv_tokens = num_prompt_tokens + max_tokens - 1
        capacity = self.block_manager.num_tokens_capacity
        if num_kv_tokens > capacity:
            raise ValueError(
                f"{name}: prompt of {num_prompt_tokens} tokens + max_tokens={max_tokens} needs "
                f"KV cache for {num_kv_tokens} tokens, but the whole KV cache holds {capacity} "
                f"({self.block_manager.num_blocks} blocks of {self.block_manager.block_size}); "
                "shorten the prompt or lower max_tokens, or give the KV cache more memory "
                "(gpu_memory_utilization, num_gpu_blocks_override)"
            )


def _decodes_lead(scheduled: list[ScheduledRequest]) -> bool:
    """Whether no prefill comes before a decode (then the sort would change nothing)."""
    seen_prefill = False
    for item in scheduled:
        if not item.is_decode:
            seen_prefill = True
        elif seen_prefill:
            return False
    return True


def _tokens_per_step(
    scheduler_output: SchedulerOutput, sampled_token_ids: Sequence[int]
) -> list[tuple[ScheduledRequest, int]]:
    """Pair each token with its request: step 0's tokens first, each step in scheduled order."""
    num_steps = scheduler_output.num_steps
    if num_steps == 1:
        return _tokens_per_request(scheduler_output, sampled_token_ids)
    producing = scheduler_output.producing_requests
    if len(sampled_token_ids) != num_steps * len(producing):
        raise ValueError(
            f"got {len(sampled_token_ids)} sampled tokens for {num_steps} decode steps of "
            f"{len(producing)} requests; pass {num_steps} tokens per request, step by step"
        )
    num_requests = len(producing)
    return [
        (producing[index % num_requests], int(token))
        for index, token in enumerate(sampled_token_ids)
    ]


def _tokens_per_request(
    scheduler_output: SchedulerOutput, sampled_token_ids: Sequence[int]
) -> list[tuple[ScheduledRequest, int]]:
    """Pair each scheduled request that produces a token with its token, in scheduled order."""
    producing = scheduler_output.producing_requests
    if len(sampled_token_ids) == len(producing):
        return [(scheduled, int(token)) for scheduled, token in zip(producing, sampled_token_ids)]
    scheduled_requests = scheduler_output.scheduled_requests
    if len(sampled_token_ids) == len(scheduled_requests):
        pairs = zip(scheduled_requests, sampled_token_ids)
        return [(scheduled, int(token)) for scheduled, token in pairs if scheduled.produces_token]
    raise ValueError(
        f"got {len(sampled_token_ids)} sampled tokens for a step of {len(scheduled_requests)} "
        f"requests of which {len(producing)} produce a token; pass one token per producing request"
    )


def _reaches_max_tokens(request: Request) -> bool:
    """Its tokens on the device already make ``max_tokens``: scheduling it again would overrun."""
    return (
        request.num_output_placeholders > 0
        and request.num_output_tokens + request.num_output_placeholders
        >= request.sampling_params.max_tokens
    )


def _check_stop(request: Request, token_id: int) -> RequestStatus | None:
    """Stop on EOS (unless ignore_eos) or a stop token, else on max_tokens (stops win)."""
    params = request.sampling_params
    if not params.ignore_eos and token_id == request.eos_token_id:
        return RequestStatus.FINISHED_STOPPED
    if token_id in params.stop_token_ids:
        return RequestStatus.FINISHED_STOPPED
    if request.num_output_tokens >= params.max_tokens:
        return RequestStatus.FINISHED_LENGTH_CAPPED
    return None
