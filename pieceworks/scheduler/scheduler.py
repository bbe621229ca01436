"""``Scheduler``: continuous batching of prefills and decodes under a per-step token budget.

vLLM v1's shape: there are no separate prefill and decode phases. Each step every request asks to
compute its uncomputed tokens (``Request.num_uncomputed_tokens``: the whole prompt for a new
request, one token for a decoding one); running requests are served first, then waiting ones are
admitted, until ``max_num_batched_tokens`` or ``max_num_seqs`` is reached. The order of both, and
which running request is preempted by recompute when KV blocks run out, is the scheduling policy's
(``SchedulerConfig.policy``, ``policy.py``): by default first-come first-served, preempting the
most recently admitted. A prompt longer than the budget left is cut into chunks over several steps
(chunked prefill). The scheduler owns the request queues, the ``BlockManager`` and the
``StateSlotManager``; it never touches tensors (the model runner turns a ``SchedulerOutput``,
``output.py``, into input buffers) and never samples (the ``Sampler`` does;
``update_from_output`` takes its tokens).

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
asks for logprobs or structured output, and nobody waits for a free seat) runs as one multi-step
output (``SchedulerOutput.num_steps``): the runner runs up to K decode steps back to back on the
device, each feeding its sampled ids to the next. ``schedule()`` reserves the KV blocks of all
of them, limits the steps to the fewest tokens any request has left before ``max_tokens``, and
counts K placeholders per request; ``update_from_output`` takes K tokens per request and applies
them in step order, exactly as K single steps would, dropping the tokens after a request's stop.

With prefix caching (``CacheConfig.enable_prefix_caching``, ``block_manager.py``) a waiting
request is admitted with the cached blocks its tokens start with counted as computed, so only the
rest is prefilled (and chunked); a request that asks for ``prompt_logprobs`` computes its whole
prompt. Each ``schedule()`` first registers the full blocks that the steps already launched
computed, so a request admitted in the same step as another that is still computing a shared
prefix recomputes it rather than reading KV not yet written. Hybrid models (Mamba state slots,
which cannot be rewound to a block boundary) run without it.
Speculative decodes also compute their proposals, in lookahead KV slots (``spec_decode.py``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from pieceworks.config import CacheConfig, SchedulerConfig
from pieceworks.logger import init_logger
from pieceworks.scheduler import spec_decode
from pieceworks.scheduler.block_manager import BlockManager, StateSlotManager
from pieceworks.scheduler.output import ScheduledRequest, SchedulerOutput, pair_sampled_tokens
from pieceworks.scheduler.policy import make_scheduling_policy
from pieceworks.scheduler.request import Request, RequestStatus, check_stop
from pieceworks.scheduler.request_timing import RequestTiming

logger = init_logger(__name__)


class Scheduler:
    """Token-budget scheduler with chunked prefill and recompute preemption.

    Invariants: the running request served first is never preempted, so the batch always
    progresses, and ``add_request`` rejects any request that could not run alone; under fcfs every
    accepted request therefore finishes (under priority a low-priority one waits while higher
    ones keep arriving, as in vLLM); blocks and state
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
        model_identity: str = "",
        sliding_window: int | None = None,
    ) -> None:
        self.max_num_seqs = scheduler_config.max_num_seqs
        self.max_num_batched_tokens = scheduler_config.max_num_batched_tokens
        self.max_model_len = max_model_len
        enable_prefix_caching = cache_config.enable_prefix_caching
        if enable_prefix_caching and num_state_slots:
            logger.info(
                "prefix caching is off: this model has recurrent (Mamba or gated delta-rule) "
                "layers, whose state cannot be "
                "rewound to a cached block"
            )
            enable_prefix_caching = False
        self.block_manager = BlockManager(
            num_blocks, cache_config.block_size, enable_prefix_caching, model_identity
        )
        # Only hybrid models (with Mamba layers) are given state slots.
        self.state_slot_manager = StateSlotManager(num_state_slots) if num_state_slots else None
        self.policy = make_scheduling_policy(scheduler_config.policy)
        self.waiting = self.policy.make_waiting_queue()
        self.running: list[Request] = []  # in service order: the last is preempted first
        self.requests: dict[str, Request] = {}
        # Scheduled steps whose tokens have not come back yet, oldest first.
        self._pending_outputs: deque[SchedulerOutput] = deque()
        self.max_pending_outputs = 2 if async_scheduling else 1
        self.num_scheduler_steps = scheduler_config.num_scheduler_steps
        self.spec_decoding_stats = spec_decode.SpecDecodingStats()
        self.timing = RequestTiming()  # queue and prefill times (request_timing.py)
        # Set when every attention layer has a sliding window: blocks before a running request's
        # window are freed as it advances (``BlockManager.free_blocks_outside_window``).
        self.sliding_window = sliding_window

    def add_request(self, request: Request) -> None:
        """Queue ``request``; raise ``ValueError`` if it could never run to completion."""
        self._verify_request(request)
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.add_request(request)

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
        block_manager = self.block_manager
        if block_manager.enable_prefix_caching:
            block_size = block_manager.block_size
            for request in self.running:  # the KV of the steps launched so far
                if request.num_computed_tokens >= (request.num_cached_blocks + 1) * block_size:
                    block_manager.cache_computed_blocks(request)  # a block filled since
        scheduled: list[ScheduledRequest] = []
        preempted: list[Request] = []
        num_steps = self._num_decode_steps()
        token_budget = self._schedule_running(
            scheduled, preempted, self.max_num_batched_tokens, num_steps
        )
        if not preempted:  # after a preemption memory is short: admit nobody new (as vLLM)
            self._schedule_waiting(scheduled, token_budget)
        # Under fcfs the service order already lists decodes first (a prompt is cut only when the
        # budget runs out, so only the last request served can be mid-prefill); under priority a
        # request still mid-prefill may be served ahead of decodes. The stable sort guarantees it.
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
        output = scheduler_output
        tokens = pair_sampled_tokens(output, sampled_token_ids)  # validate first
        self._pending_outputs.popleft()
        if output.num_verify_columns > 1:
            stats = self.spec_decoding_stats
            finished = spec_decode.apply_verified_step(output, tokens, stats, self._finish)
        else:
            finished = []
            for scheduled, token_id in tokens:
                request = scheduled.request
                request.num_output_placeholders -= 1
                if request.is_finished:
                    continue  # it stopped on an earlier step's token: this one is past its end
                request.output_token_ids.append(token_id)
                status = check_stop(request, token_id)
                if status is not None:
                    self._finish(request, status)
                    finished.append(request)
        self.timing.tokens_arrived()
        return finished

    def drop_pending_outputs(self) -> list[SchedulerOutput]:
        """Forget the scheduled steps still awaiting their tokens (their step failed) and
        return them, oldest first; the caller finishes their requests."""
        outputs = list(self._pending_outputs)
        self._pending_outputs.clear()
        for output in outputs:  # their KV may never be written: no later request may read it
            for scheduled in output.scheduled_requests:
                self.block_manager.uncache(scheduled.request)
        return outputs

    def _num_decode_steps(self) -> int:
        """How many decode steps the next batch runs back to back: ``num_scheduler_steps`` when
        every running request it would serve decodes, none asks for logprobs, no waiting request
        could take a free seat, and the KV blocks of all the steps are free; fewer when a request
        has fewer tokens left before ``max_tokens``; else 1 (a step as without multi-step)."""
        num_steps = self.num_scheduler_steps
        if num_steps == 1 or (self.waiting and len(self.running) < self.max_num_seqs):
            return 1  # the waiting head is admitted now, as it would be without multi-step
        serving = [request for request in self.running if not request.reaches_max_tokens]
        if not serving:
            return 1  # every running request awaits its last token: nothing to run
        for request in serving:
            if request.num_uncomputed_tokens != 1 or request.num_computed_tokens == 0:
                return 1  # a prefill (or a prompt chunk) runs single-step
            if request.sampling_params.logprobs is not None:
                return 1  # logprobs are taken per single step
            if request.sampling_params.structured_outputs is not None:
                return 1  # its grammar masks each step's logits on the host
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
        """Serve running requests in service order, preempting from its end when short;
        ``num_steps`` decode steps each (``_num_decode_steps`` checked their blocks are free)."""
        index, running = 0, self.running
        while index < len(running) and token_budget > 0:
            request = running[index]
            if request.reaches_max_tokens:
                index += 1  # its pending token is its last: it finishes on the update
                continue
            num_new_tokens = min(request.num_uncomputed_tokens, token_budget)
            proposals = spec_decode.proposals_to_verify(request, token_budget, self.block_manager)
            num_new_tokens += len(proposals)  # their KV slots: the lookahead slots
            num_kv_tokens = num_new_tokens + num_steps - 1  # the later steps' KV, reserved ahead
            if self.sliding_window is not None:
                self.block_manager.free_blocks_outside_window(request, self.sliding_window)
            if not self._allocate_or_preempt(request, num_kv_tokens, preempted):
                break  # the request preempted itself: it was the last left in service order
            scheduled.append(ScheduledRequest(request, num_new_tokens, proposals))
            token_budget -= num_new_tokens
            index += 1
        return token_budget

    def _allocate_or_preempt(
        self, request: Request, num_new_tokens: int, preempted: list[Request]
    ) -> bool:
        # Victims come from the end of ``running`` (the policy keeps it in service order): always
        # behind ``request``, so never a request already scheduled this step, and never the front
        # one (which therefore always progresses).
        while not self.block_manager.allocate(request, num_new_tokens):
            victim = self.policy.pop_preemption_victim(self.running)
            self._preempt(victim)
            preempted.append(victim)
            if victim is request:
                return False
        return True

    def _schedule_waiting(self, scheduled: list[ScheduledRequest], token_budget: int) -> None:
        """Admit waiting requests in the policy's order while budget, seats and memory last."""
        while self.waiting and token_budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting.peek_request()
            if request.num_output_placeholders:
                break  # preempted with a token still on the device: resume once it is known
            computed_blocks = self._computed_blocks(request)
            num_hit_tokens = len(computed_blocks or ()) * self.block_manager.block_size
            num_new_tokens = min(request.num_uncomputed_tokens - num_hit_tokens, token_budget)
            if not self._allocate_for_admission(request, num_new_tokens, computed_blocks):
                break  # no skipping ahead: the head of the queue waits for memory
            if computed_blocks is not None:
                self.block_manager.record_lookup(request, num_hit_tokens)
            request.num_computed_tokens = num_hit_tokens
            self.waiting.pop_request()
            request.status = RequestStatus.RUNNING
            self.timing.scheduled(request)
            self.policy.add_running(self.running, request)
            scheduled.append(ScheduledRequest(request, num_new_tokens))
            token_budget -= num_new_tokens

    def _computed_blocks(self, request: Request) -> list[int] | None:
        """The cached blocks ``request`` starts with; None when it does not look (prefix caching
        off, or it asks for ``prompt_logprobs``, which needs every prompt position computed)."""
        if not self.block_manager.enable_prefix_caching:
            return None
        if request.sampling_params.prompt_logprobs is not None:
            return None
        return self.block_manager.get_computed_blocks(request)

    def _allocate_for_admission(
        self, request: Request, num_new_tokens: int, computed_blocks: list[int] | None
    ) -> bool:
        slots = self.state_slot_manager
        if slots is not None and slots.num_free_slots == 0:
            return False
        if not self.block_manager.allocate(request, num_new_tokens, computed_blocks):
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
        self.waiting.prepend_request(request)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.finish(status)
        if request in self.running:
            self.running.remove(request)
        else:  # preempted while its last token was still on the device
            self.waiting.remove_request(request)
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
        self.policy.verify_request(request)
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
