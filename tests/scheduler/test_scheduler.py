"""The scheduler keeps its invariants on random workloads driven by a deterministic fake model.

Proves: many more requests than ``max_num_seqs`` all finish; every step respects the token budget
and the sequence limit and lists decodes first; chunked prefills stay within the budget and resume
where they stopped; with a tiny block pool requests are preempted, resume by recomputing prompt +
generated tokens, and produce exactly the tokens of an unpreempted run; no KV block or Mamba state
slot is shared while held (a prefix-cache block only, read by each holder) or leaked after the
last request finishes; impossible requests are
rejected with a message (matched in full); EOS, stop ids, ``ignore_eos`` and ``max_tokens`` stop
generation; no step computes a request's last position (prompt + max_tokens - 1) or schedules a
request whose pending token is its last, and such a request holds back no other; a full budget is
spent; the views sent to other ranks keep what a runner reads; steps are updated oldest first.

The fake model runner writes each step's tokens into a simulated paged KV cache through
``block_ids`` and reads the whole context back through them, so a block handed to two requests at
once, or a wrong ``num_computed_tokens``, changes the tokens and fails the test. The random
workloads run twice: synchronously, and with async scheduling, where step N+1 is scheduled and run
before step N's tokens reach the scheduler (the fake runner reads a pending token from its own
"device" copy of the last sampled ids, as the real runner does); both must give the reference
tokens exactly, so a late stop must drop the extra token and max_tokens must never be overrun.

Run: pytest tests/scheduler/test_scheduler.py
"""

from __future__ import annotations

import random
from collections import Counter, deque
from collections.abc import Sequence

import pytest

from pieceworks.config import CacheConfig, SchedulerConfig
from pieceworks.sampling_params import SamplingParams
from pieceworks.scheduler.block_manager import BlockManager, StateSlotManager, cdiv
from pieceworks.scheduler.output import PLACEHOLDER_TOKEN_ID, ScheduledRequest, SchedulerOutput
from pieceworks.scheduler.request import Request, RequestStatus
from pieceworks.scheduler.scheduler import Scheduler

VOCAB_SIZE = 48
EOS_TOKEN_ID = 0
_MODULUS = (1 << 61) - 1


def rolling_hash(token_ids: Sequence[int], state: int = 0) -> int:
    for token_id in token_ids:
        state = (state * 1_000_003 + token_id + 1) % _MODULUS
    return state


def next_token(context: Sequence[int]) -> int:
    """The fake model: a deterministic function of the whole context, as a real LM is."""
    return rolling_hash(context) % VOCAB_SIZE


def reference_output(request: Request) -> tuple[list[int], str]:
    """What generation must produce, computed without any scheduler."""
    params, token_ids, output = request.sampling_params, list(request.prompt_token_ids), []
    while True:
        token_id = next_token(token_ids)
        token_ids.append(token_id)
        output.append(token_id)
        stopped = token_id == request.eos_token_id and not params.ignore_eos
        if stopped or token_id in params.stop_token_ids:
            return output, "stop"
        if len(output) >= params.max_tokens:
            return output, "length"


class FakeModelRunner:
    """Stores tokens as 'KV' in paged slots and a rolling hash as 'Mamba state' per slot."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.block_size = scheduler.block_manager.block_size
        self.kv_cache = [-1] * scheduler.block_manager.num_tokens_capacity
        slots = scheduler.state_slot_manager
        self.state_cache: list[int | None] = [None] * (slots.num_slots if slots else 0)
        self.last_sampled: dict[str, int] = {}  # the "device" copy of the last step's tokens

    def slot(self, request: Request, position: int) -> int:
        return request.block_ids[position // self.block_size] * self.block_size + (
            position % self.block_size
        )

    def execute(self, output: SchedulerOutput) -> list[int]:
        # Write every request's KV before reading any: a block shared by two requests shows up.
        new_token_ids = {}
        for scheduled in output.scheduled_requests:
            start, request_id = scheduled.num_computed_tokens, scheduled.request.request_id
            new_token_ids[request_id] = [  # a pending token is on the "device" (async)
                self.last_sampled[request_id] if token_id == PLACEHOLDER_TOKEN_ID else token_id
                for token_id in scheduled.new_token_ids
            ]
            for offset, token_id in enumerate(new_token_ids[request_id]):
                self.kv_cache[self.slot(scheduled.request, start + offset)] = token_id
        sampled, last_sampled = [], {}
        for scheduled in output.scheduled_requests:
            request, end = (
                scheduled.request,
                scheduled.num_computed_tokens + scheduled.num_new_tokens,
            )
            context = [self.kv_cache[self.slot(request, position)] for position in range(end)]
            known = request.all_token_ids[:end]  # a pending token is not known yet
            assert context[: len(known)] == known, f"{request.request_id}: KV corrupted"
            if self.state_cache:
                self.update_state(scheduled, new_token_ids[request.request_id], context)
            if scheduled.produces_token:
                sampled.append(next_token(context))
                last_sampled[request.request_id] = sampled[-1]
        self.last_sampled = last_sampled
        return sampled

    def update_state(self, scheduled, new_token_ids: list[int], context: list[int]) -> None:
        slot = scheduled.request.state_slot
        assert slot is not None and slot != StateSlotManager.NULL_SLOT
        # A prefill from position 0 starts from a zero state; anything else continues the slot's.
        state = 0 if scheduled.num_computed_tokens == 0 else self.state_cache[slot]
        state = rolling_hash(new_token_ids, state)
        assert state == rolling_hash(context), "Mamba state slot shared or stale"
        self.state_cache[slot] = state


def make_scheduler(
    max_num_seqs=4,
    max_num_batched_tokens=64,
    num_blocks=256,
    block_size=4,
    num_state_slots=0,
    async_scheduling=False,
    enable_prefix_caching=True,
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens),
        CacheConfig(block_size=block_size, enable_prefix_caching=enable_prefix_caching),
        max_model_len=256,
        num_blocks=num_blocks,
        num_state_slots=num_state_slots,
        async_scheduling=async_scheduling,
    )


def random_requests(seed: int, num_requests: int, max_prompt_len=40, max_tokens=30) -> list:
    rng = random.Random(seed)
    requests = []
    for index in range(num_requests):
        prompt = [rng.randrange(1, VOCAB_SIZE) for _ in range(rng.randint(1, max_prompt_len))]
        params = SamplingParams(
            temperature=0.0,
            max_tokens=rng.randint(1, max_tokens),
            ignore_eos=rng.random() < 0.3,
            stop_token_ids=[rng.randrange(1, VOCAB_SIZE)] if rng.random() < 0.3 else [],
        )
        requests.append(Request(f"req-{index}", prompt, params, eos_token_id=EOS_TOKEN_ID))
    return requests


def check_step(scheduler: Scheduler, output: SchedulerOutput) -> None:
    """Per-step invariants: limits, decode-first order, progress, exclusive blocks and slots."""
    assert output.num_requests > 0, "unfinished requests but nothing scheduled"
    assert all(scheduled.num_new_tokens > 0 for scheduled in output.scheduled_requests)
    assert output.num_scheduled_tokens <= scheduler.max_num_batched_tokens
    assert output.num_requests <= scheduler.max_num_seqs
    decode_flags = [scheduled.is_decode for scheduled in output.scheduled_requests]
    assert decode_flags == sorted(decode_flags, reverse=True), "decodes must come first"
    # A block is shared only while it is a prefix-cache block (read, never written) of each
    # holder; the rest of a request's blocks are its own, and reference counts count holders.
    manager = scheduler.block_manager
    held = Counter(block for request in scheduler.running for block in request.block_ids)
    for request in scheduler.running:
        written = request.block_ids[request.num_cached_blocks :]
        assert all(held[block] == 1 for block in written), "a block is held by two requests"
    assert all(manager.ref_counts[block] == count for block, count in held.items())
    assert len(held) + manager.num_free_blocks == manager.num_blocks
    for scheduled in output.scheduled_requests:
        request = scheduled.request
        needed = scheduled.num_computed_tokens + scheduled.num_new_tokens
        assert len(request.block_ids) == cdiv(needed, scheduler.block_manager.block_size)
        # The last token a request may produce is never fed back: a step that computes position
        # prompt + max_tokens - 1 or later is wasted and writes KV beyond the request's budget.
        max_tokens = request.sampling_params.max_tokens
        assert needed <= request.num_prompt_tokens + max_tokens - 1, request.request_id
        assert request.num_output_tokens + request.num_output_placeholders <= max_tokens
    for request in output.preempted_requests:
        assert request.status == RequestStatus.PREEMPTED and not request.block_ids
        assert request.num_computed_tokens == 0 and request.state_slot is None
    if scheduler.state_slot_manager is not None:
        slots = [request.state_slot for request in scheduler.running]
        assert None not in slots and 0 not in slots and len(slots) == len(set(slots))


def run_to_completion(scheduler: Scheduler, requests: list[Request], max_steps=20_000) -> list:
    """Drive schedule → fake model → update until every request finishes; return the outputs.

    With async scheduling, step N+1 is scheduled and run before step N's update, as the engine
    does; a step may then schedule nothing while the only running requests await their last token.
    """
    runner = FakeModelRunner(scheduler)
    for request in requests:
        scheduler.add_request(request)
    outputs, num_finished = [], 0
    in_flight: tuple[SchedulerOutput, list[int]] | None = None
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests() and in_flight is None:
            break
        output = scheduler.schedule()
        if output.scheduled_requests or in_flight is None:
            check_step(scheduler, output)
        launched = (output, runner.execute(output)) if output.scheduled_requests else None
        if in_flight is not None:
            num_finished += len(scheduler.update_from_output(*in_flight))
        in_flight = launched
        if scheduler.max_pending_outputs == 1 and in_flight is not None:
            num_finished += len(scheduler.update_from_output(*in_flight))
            in_flight = None
        if launched is not None or output.preempted_requests:  # a step may only preempt
            outputs.append(output)
    assert not scheduler.has_unfinished_requests(), "requests left unfinished"
    assert num_finished == len(requests)
    check_no_leaks(scheduler)
    return outputs


def check_no_leaks(scheduler: Scheduler) -> None:
    manager = scheduler.block_manager
    assert sorted(manager.free_block_ids) == list(range(manager.num_blocks))
    if scheduler.state_slot_manager is not None:
        slots = scheduler.state_slot_manager
        assert sorted(slots.free_slots) == list(range(1, slots.num_slots))
    assert not scheduler.requests and not scheduler.running and not scheduler.waiting


def check_matches_reference(requests: list[Request]) -> None:
    for request in requests:
        assert request.is_finished
        assert (request.output_token_ids, request.finish_reason) == reference_output(request)


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_many_more_requests_than_max_num_seqs_all_finish(seed, async_scheduling):
    requests = random_requests(seed, num_requests=40)
    scheduler = make_scheduler(3, 24, async_scheduling=async_scheduling)
    outputs = run_to_completion(scheduler, requests)
    check_matches_reference(requests)
    assert max(output.num_requests for output in outputs) == 3
    assert any(output.is_uniform_decode for output in outputs)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_request_whose_last_token_is_pending_is_not_scheduled_again(async_scheduling):
    """max_tokens=3: a prefill and two decodes, then nothing while the third token is in flight."""
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    request = Request("only", [5, 6, 7], params, eos_token_id=EOS_TOKEN_ID)
    steps = run_to_completion(make_scheduler(async_scheduling=async_scheduling), [request])
    assert [step.num_scheduled_tokens for step in steps] == [3, 1, 1]
    assert request.output_token_ids == reference_output(request)[0]
    assert request.finish_reason == "length"


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_chunked_prefill_respects_budget_and_resumes_where_it_stopped(async_scheduling):
    requests = random_requests(7, num_requests=12, max_prompt_len=60)
    scheduler = make_scheduler(4, 8, async_scheduling=async_scheduling)
    outputs = run_to_completion(scheduler, requests)
    check_matches_reference(requests)
    chunks: dict[str, list[tuple[int, int]]] = {}
    for output in outputs:
        for scheduled in output.scheduled_requests:
            if scheduled.num_computed_tokens < scheduled.request.num_prompt_tokens:
                chunks.setdefault(scheduled.request.request_id, []).append(
                    (scheduled.num_computed_tokens, scheduled.num_new_tokens)
                )
    assert max(len(request_chunks) for request_chunks in chunks.values()) > 1
    for request in requests:
        starts = [start for start, _ in chunks[request.request_id]]
        ends = [start + length for start, length in chunks[request.request_id]]
        assert starts == [0] + ends[:-1], "a chunk must start where the previous one ended"
        assert ends[-1] >= request.num_prompt_tokens


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("num_state_slots", [0, 5, 3])
@pytest.mark.parametrize("seed", range(3))
def test_preemption_resumes_with_the_same_tokens(seed, num_state_slots, async_scheduling):
    """6 blocks of 4 = 24 KV tokens: enough for any one request (<= 15 + 10 - 1), not for four."""
    requests = random_requests(seed, num_requests=16, max_prompt_len=15, max_tokens=10)
    ample = [
        Request(r.request_id, r.prompt_token_ids, r.sampling_params, EOS_TOKEN_ID) for r in requests
    ]
    run_to_completion(make_scheduler(num_state_slots=num_state_slots), ample)
    tiny = make_scheduler(
        max_num_seqs=4,
        num_blocks=6,
        num_state_slots=num_state_slots,
        async_scheduling=async_scheduling,
    )
    outputs = run_to_completion(tiny, requests)
    num_preempted = sum(len(output.preempted_requests) for output in outputs)
    assert num_preempted > 0
    assert sum(request.num_preemptions for request in requests) == num_preempted
    for with_preemption, without in zip(requests, ample):
        assert with_preemption.output_token_ids == without.output_token_ids
        assert with_preemption.finish_reason == without.finish_reason
    check_matches_reference(requests)
    if num_state_slots:  # slot 0 is the null slot: num_state_slots - 1 requests run at once
        assert max(output.num_requests for output in outputs) <= min(4, num_state_slots - 1)


@pytest.mark.parametrize("enable_prefix_caching", [False, True])
def test_resumed_request_recomputes_prompt_and_generated_tokens(enable_prefix_caching):
    """4 blocks of 4: two 4-token prompts decode side by side until each needs a third block.
    With prefix caching the resumed request finds its prompt's block still cached (its second
    block, the tail, was evicted first to give ``first`` its third block) and recomputes the
    rest."""
    scheduler = make_scheduler(
        max_num_seqs=2, num_blocks=4, enable_prefix_caching=enable_prefix_caching
    )
    num_cached = 4 if enable_prefix_caching else 0
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    first, second, third = (
        Request(name, prompt, params)
        for name, prompt in [("first", [1, 2, 3, 4]), ("second", [5, 6, 7, 8]), ("third", [9])]
    )
    runner = FakeModelRunner(scheduler)
    for request in (first, second, third):
        scheduler.add_request(request)
    resumed = None
    while scheduler.has_unfinished_requests():
        output = scheduler.schedule()
        if output.preempted_requests:
            assert output.preempted_requests == [second]  # the newest running one
            detached = output.detached()  # what another rank's runner receives
            assert [r.request_id for r in detached.preempted_requests] == ["second"]
            assert detached.preempted_requests[0].prompt_token_ids == []  # a runner view
            assert list(scheduler.waiting) == [second, third]  # back at the front of the queue
            generated_before = list(second.output_token_ids)
            assert generated_before
        for scheduled in output.scheduled_requests:
            if scheduled.request is second and second.num_preemptions and resumed is None:
                resumed = scheduled
                assert scheduled.num_computed_tokens == num_cached and not scheduled.is_decode
                assert scheduled.new_token_ids == ([5, 6, 7, 8] + generated_before)[num_cached:]
        scheduler.update_from_output(output, runner.execute(output))
    assert resumed is not None and second.num_preemptions == 1 and first.num_preemptions == 0
    check_matches_reference([first, second, third])
    check_no_leaks(scheduler)


def test_impossible_requests_are_rejected_with_a_message():
    scheduler = Scheduler(SchedulerConfig(4, 64), CacheConfig(block_size=4), 32, num_blocks=4)

    def refused(request: Request) -> str:
        with pytest.raises(ValueError) as error:
            scheduler.add_request(request)
        return str(error.value)

    # Each message names the request, what does not fit, and what to change.
    assert refused(Request("long", [1] * 30, SamplingParams(max_tokens=16))) == (
        "request 'long': prompt of 30 tokens + max_tokens=16 = 46 exceeds max_model_len=32; "
        "shorten the prompt, lower max_tokens, or raise max_model_len"
    )
    assert refused(Request("kv", [1] * 10, SamplingParams(max_tokens=10))) == (
        "request 'kv': prompt of 10 tokens + max_tokens=10 needs KV cache for 19 tokens, but the "
        "whole KV cache holds 16 (4 blocks of 4); shorten the prompt or lower max_tokens, or give "
        "the KV cache more memory (gpu_memory_utilization, num_gpu_blocks_override)"
    )
    assert refused(Request("empty", [], SamplingParams())) == (
        "request 'empty' has an empty prompt; pass at least one token"
    )
    assert refused(Request("at-limit", [1] * 16, SamplingParams(max_tokens=16))).endswith(
        "needs KV cache for 31 tokens, but the whole KV cache holds 16 (4 blocks of 4); shorten "
        "the prompt or lower max_tokens, or give the KV cache more memory "
        "(gpu_memory_utilization, num_gpu_blocks_override)"
    )  # 16 + 16 = max_model_len exactly: allowed by length, refused by the KV cache
    scheduler.add_request(Request("fits", [1] * 8, SamplingParams(max_tokens=9)))  # 16 KV tokens
    assert refused(Request("fits", [1], SamplingParams())) == (
        "request 'fits' is already scheduled; give each request a unique id"
    )
    assert scheduler.get_num_unfinished_requests() == 1
    scheduler.schedule()  # synchronous by default: one step at a time
    with pytest.raises(RuntimeError) as error:
        scheduler.schedule()
    assert str(error.value) == (
        "schedule() called with 1 steps awaiting update_from_output() (the most this scheduler "
        "allows); update first"
    )


def test_num_unfinished_requests_counts_running_and_waiting():
    scheduler = make_scheduler(max_num_seqs=2)
    requests = [Request(f"r{i}", [1, 2], SamplingParams(max_tokens=2)) for i in range(3)]
    for request in requests:
        scheduler.add_request(request)
    output = scheduler.schedule()  # two run, one waits for a seat
    assert (len(scheduler.running), len(scheduler.waiting)) == (2, 1)
    assert scheduler.get_num_unfinished_requests() == 3
    scheduler.finish_requests(["r0"], RequestStatus.FINISHED_ABORTED)
    assert scheduler.get_num_unfinished_requests() == 2
    scheduler.update_from_output(output, [7, 7])


def test_detached_step_keeps_what_a_runner_reads_and_drops_the_tokens():
    """The view of a step sent to other tensor-parallel ranks: every scheduled field, and per
    request its id, sampling parameters, EOS id, blocks and state slot, but no token history."""
    scheduler = make_scheduler(max_num_seqs=2, max_num_batched_tokens=6, num_state_slots=4)
    params = SamplingParams(temperature=0.7, top_k=5, max_tokens=3, seed=11)
    short, long = Request("short", [1, 2], params, 0), Request("long", [3] * 10, params, 9)
    scheduler.add_request(short)
    scheduler.add_request(long)
    output = scheduler.schedule()
    detached = output.detached()
    assert detached.preempted_requests == []
    assert len(detached.scheduled_requests) == 2
    for original, copy in zip(output.scheduled_requests, detached.scheduled_requests):
        fields = ("num_new_tokens", "num_computed_tokens", "produces_token", "new_token_ids")
        for field in fields:
            assert getattr(copy, field) == getattr(original, field), field
        view, request = copy.request, original.request
        assert view is not request and view.request_id == request.request_id
        assert view.sampling_params == request.sampling_params
        assert view.eos_token_id == request.eos_token_id
        assert view.block_ids == request.block_ids and view.block_ids is not request.block_ids
        assert view.state_slot == request.state_slot is not None
        assert view.prompt_token_ids == [] and view.output_token_ids == []


def generate_scripted(params: SamplingParams, script: list[int]) -> Request:
    """Run one request whose 'model' emits ``script`` in order."""
    scheduler = make_scheduler()
    request = Request("scripted", [3, 4, 5], params, eos_token_id=EOS_TOKEN_ID)
    scheduler.add_request(request)
    tokens = iter(script)
    while scheduler.has_unfinished_requests():
        output = scheduler.schedule()
        scheduler.update_from_output(output, [next(tokens) for _ in output.producing_requests])
    check_no_leaks(scheduler)
    return request


@pytest.mark.parametrize(
    "params, expected_output, expected_reason",
    [
        (SamplingParams(max_tokens=10), [7, 8, EOS_TOKEN_ID], "stop"),
        (SamplingParams(max_tokens=5, ignore_eos=True), [7, 8, EOS_TOKEN_ID, 9, 10], "length"),
        (SamplingParams(max_tokens=10, stop_token_ids=[8]), [7, 8], "stop"),
        (SamplingParams(max_tokens=2), [7, 8], "length"),
        (SamplingParams(max_tokens=3), [7, 8, EOS_TOKEN_ID], "stop"),  # stop wins over length
    ],
)
def test_stop_conditions(params, expected_output, expected_reason):
    request = generate_scripted(params, [7, 8, EOS_TOKEN_ID, 9, 10, 11, 12])
    assert request.output_token_ids == expected_output
    assert request.finish_reason == expected_reason
    expected_status = {
        "stop": RequestStatus.FINISHED_STOPPED,
        "length": RequestStatus.FINISHED_LENGTH_CAPPED,
    }
    assert request.status == expected_status[expected_reason]


def test_produces_token_and_the_two_accepted_token_layouts():
    scheduler = make_scheduler(max_num_seqs=2, max_num_batched_tokens=6)
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    short, long = Request("short", [1, 2], params), Request("long", [1] * 10, params)
    scheduler.add_request(short)
    scheduler.add_request(long)
    output = scheduler.schedule()  # short: whole prompt (2); long: first chunk (4 of 10)
    assert [(s.num_new_tokens, s.produces_token) for s in output.scheduled_requests] == [
        (2, True),
        (4, False),
    ]
    assert output.num_scheduled_tokens == 6 and not output.is_uniform_decode
    with pytest.raises(RuntimeError, match="awaiting update_from_output"):
        scheduler.schedule()
    with pytest.raises(ValueError, match="3 sampled tokens for a step of 2 requests"):
        scheduler.update_from_output(output, [1, 2, 3])
    scheduler.update_from_output(output, [9, 99])  # one per scheduled request: 99 is ignored
    assert short.output_token_ids == [9] and long.output_token_ids == []
    assert long.num_computed_tokens == 4
    output = scheduler.schedule()  # short decodes first, long continues with 5 of its 6
    assert [(s.request, s.num_new_tokens) for s in output.scheduled_requests] == [
        (short, 1),
        (long, 5),
    ]
    assert output.scheduled_requests[0].is_decode
    scheduler.update_from_output(output, [10])  # one per producing request
    assert short.output_token_ids == [9, 10] and long.num_computed_tokens == 9


def test_uniform_decode_after_prefill():
    scheduler = make_scheduler()
    for index in range(3):
        scheduler.add_request(Request(f"r{index}", [1, 2, 3], SamplingParams(max_tokens=4)))
    prefill = scheduler.schedule()
    assert not prefill.is_uniform_decode and prefill.num_scheduled_tokens == 9
    scheduler.update_from_output(prefill, [5, 6, 7])
    decode = scheduler.schedule()
    assert decode.is_uniform_decode and decode.num_scheduled_tokens == decode.num_decodes == 3


def test_block_manager_allocates_on_demand_and_all_or_nothing():
    manager = BlockManager(num_blocks=3, block_size=4)
    request = Request("r", [1] * 5)
    assert manager.blocks_needed(request, 5) == 2
    assert manager.allocate(request, 5) and len(request.block_ids) == 2
    request.num_computed_tokens = 5
    assert manager.blocks_needed(request, 3) == 0  # positions 5..7 fit in block 2
    assert not manager.allocate(request, 8)  # needs 2 more, 1 free: nothing changes
    assert len(request.block_ids) == 2 and manager.num_free_blocks == 1
    manager.free(request)
    assert manager.num_free_blocks == 3 and request.block_ids == []


def test_state_slot_manager_never_hands_out_the_null_slot():
    slots = StateSlotManager(num_slots=3)
    requests = [Request(f"r{index}", [1]) for index in range(3)]
    assert [slots.allocate(request) for request in requests] == [True, True, False]
    assert sorted(request.state_slot for request in requests[:2]) == [1, 2]
    assert slots.allocate(requests[1]) and requests[1].state_slot == 2  # it keeps its slot
    slots.free(requests[0])
    assert slots.num_free_slots == 1 and requests[0].state_slot is None
    with pytest.raises(ValueError, match="slot 0 is the null slot"):
        StateSlotManager(num_slots=1)
    assert StateSlotManager(num_slots=2).free_slots == deque([1])  # the smallest: one request


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_abort_frees_the_cache_at_once_and_the_others_keep_their_tokens(async_scheduling):
    """An abort mid-decode (with a step in flight under async scheduling) and one of a queued
    request free their blocks at once; the rest produce exactly their reference tokens."""
    requests = random_requests(7, num_requests=6, max_tokens=30)
    requests = [
        Request(r.request_id, r.prompt_token_ids, SamplingParams(temperature=0.0, max_tokens=30,
                ignore_eos=True), eos_token_id=EOS_TOKEN_ID)
        for r in requests
    ]  # fmt: skip
    scheduler = make_scheduler(2, 64, async_scheduling=async_scheduling)
    runner = FakeModelRunner(scheduler)
    for request in requests:
        scheduler.add_request(request)
    in_flight = None
    for _ in range(4):  # requests 0 and 1 run and decode; the others wait
        output = scheduler.schedule()
        launched = (output, runner.execute(output))
        if in_flight is not None:
            scheduler.update_from_output(*in_flight)
        in_flight = launched
        if not async_scheduling:
            scheduler.update_from_output(*in_flight)
            in_flight = None
    running, queued = requests[0], requests[5]
    assert running.status == RequestStatus.RUNNING and running.block_ids
    assert queued.status == RequestStatus.WAITING
    num_free = scheduler.block_manager.num_free_blocks
    num_held = len(running.block_ids)
    aborted = scheduler.finish_requests(
        [running.request_id, queued.request_id, "no-such-id"], RequestStatus.FINISHED_ABORTED
    )
    assert aborted == [running, queued]
    assert scheduler.block_manager.num_free_blocks == num_free + num_held
    assert running.finish_reason == queued.finish_reason == "abort" and not running.block_ids
    assert scheduler.finish_requests([running.request_id], RequestStatus.FINISHED_ABORTED) == []
    num_output_tokens = running.num_output_tokens
    if in_flight is not None:  # the aborted request's token still on the device is dropped
        scheduler.update_from_output(*in_flight)
    assert running.num_output_tokens == num_output_tokens
    rest = [r for r in requests if r not in (running, queued)]
    while scheduler.has_unfinished_requests():
        output = scheduler.schedule()
        if output.scheduled_requests:
            scheduler.update_from_output(output, runner.execute(output))
    check_no_leaks(scheduler)
    check_matches_reference(rest)


def test_update_from_output_takes_the_oldest_step_only():
    """With async scheduling two steps are in flight: the newer one, or one already updated,
    is refused (its tokens would land on the wrong positions)."""
    scheduler = make_scheduler(async_scheduling=True)
    request = Request("r", [1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True))
    scheduler.add_request(request)
    first, second = scheduler.schedule(), scheduler.schedule()
    with pytest.raises(RuntimeError, match="called with 2 steps awaiting"):
        scheduler.schedule()  # async scheduling runs at most one step ahead
    message = "^update_from_output\\(\\) must get the oldest scheduled output not yet updated$"
    with pytest.raises(RuntimeError, match=message):
        scheduler.update_from_output(second, [7])
    assert scheduler.update_from_output(first, [7]) == []
    with pytest.raises(RuntimeError, match=message):
        scheduler.update_from_output(first, [7])
    assert scheduler.update_from_output(second, [8]) == [request]  # the finished requests
    assert request.output_token_ids == [7, 8] and request.finish_reason == "length"


def test_a_full_budget_serves_every_running_request_each_step():
    """Budget 3, three requests of one prompt token: three prefills, then three decodes per
    step; the last token of budget is spent, never left over."""
    scheduler = make_scheduler(max_num_seqs=3, max_num_batched_tokens=3)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    for index in range(3):
        scheduler.add_request(Request(f"r{index}", [index + 1], params))
    steps = []
    while scheduler.has_unfinished_requests():
        output = scheduler.schedule()
        steps.append(output.num_scheduled_tokens)
        scheduler.update_from_output(output, [9] * len(output.producing_requests))
    assert steps == [3, 3, 3, 3]


def test_a_request_awaiting_its_last_token_does_not_hold_back_the_next():
    """Async: r0's pending token is its last (max_tokens=2), so the third step skips r0 and
    still serves r1 behind it."""
    scheduler = make_scheduler(async_scheduling=True)
    first = Request("r0", [1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True))
    second = Request("r1", [4, 5, 6], SamplingParams(max_tokens=10, ignore_eos=True))
    scheduler.add_request(first)
    scheduler.add_request(second)
    prefill, decode = scheduler.schedule(), scheduler.schedule()
    assert [s.request for s in decode.scheduled_requests] == [first, second]
    scheduler.update_from_output(prefill, [7, 8])
    third = scheduler.schedule()
    assert [(s.request, s.num_new_tokens) for s in third.scheduled_requests] == [(second, 1)]


def test_a_resumed_request_computes_prompt_then_generated_tokens_chunk_by_chunk():
    """After a preemption the prompt and the generated tokens are one prefill; chunks of it,
    inside the prompt, across the boundary and inside the outputs, each hold their own tokens."""
    request = Request("r", [1, 2, 3, 4, 5, 6], output_token_ids=[7, 8, 9])
    chunks = []
    for num_new_tokens in (4, 3, 1, 1):  # [0, 4) prompt, [4, 7) across, [7, 8), [8, 9) outputs
        scheduled = ScheduledRequest(request, num_new_tokens)
        chunks.append((scheduled.new_token_ids, scheduled.produces_token))
        request.num_computed_tokens += num_new_tokens
    assert chunks == [([1, 2, 3, 4], False), ([5, 6, 7], False), ([8], False), ([9], True)]


def test_block_manager_needs_at_least_one_block_of_at_least_one_token():
    message = (
        "num_blocks={} and block_size={} must both be >= 1; the KV cache has no room (give it "
        "more memory)"
    )
    for num_blocks, block_size in ((0, 16), (16, 0)):
        with pytest.raises(ValueError) as error:
            BlockManager(num_blocks, block_size)
        assert str(error.value) == message.format(num_blocks, block_size)
    assert BlockManager(num_blocks=1, block_size=1).num_tokens_capacity == 1


def test_check_request_raises_what_add_request_would_and_queues_nothing():
    scheduler = Scheduler(SchedulerConfig(4, 64), CacheConfig(block_size=4), 32, num_blocks=4)
    with pytest.raises(ValueError, match=r"request 'checked'.*KV cache for 19 tokens"):
        scheduler.check_request(Request("checked", [1] * 10, SamplingParams(max_tokens=10)))
    scheduler.check_request(Request("unqueued", [1] * 8, SamplingParams(max_tokens=9)))
    assert (
        not scheduler.requests and not scheduler.waiting and scheduler.schedule().num_requests == 0
    )


def test_can_allocate_counts_the_blocks_a_request_still_needs():
    manager = BlockManager(num_blocks=3, block_size=4)
    request = Request("r", [1] * 5)
    assert manager.can_allocate(request, 12) and not manager.can_allocate(request, 13)
    manager.allocate(request, 5)  # 2 blocks held, 1 free
    request.num_computed_tokens = 5
    assert manager.can_allocate(request, 7) and not manager.can_allocate(request, 8)


def test_running_requests_beyond_the_budget_wait_for_the_next_step():
    """Budget 2, three decoding requests: two decode per step and the third waits; none is
    scheduled with zero tokens."""
    scheduler = make_scheduler(max_num_seqs=3, max_num_batched_tokens=3)
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    for index in range(3):
        scheduler.add_request(Request(f"r{index}", [index + 1], params))
    prefill = scheduler.schedule()
    scheduler.update_from_output(prefill, [9, 9, 9])
    scheduler.max_num_batched_tokens = 2
    decode = scheduler.schedule()
    assert [(s.request.request_id, s.num_new_tokens) for s in decode.scheduled_requests] == [
        ("r0", 1),
        ("r1", 1),
    ]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_one_token_prompt_is_a_prefill_then_its_next_steps_are_decodes(async_scheduling):
    """A prompt of one token computes one token and samples, as a decode would, but it starts
    from no state (a Mamba layer must not read its slot): only the later steps are decodes, the
    first of them at one computed token."""
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    request = Request("one", [5], params, eos_token_id=EOS_TOKEN_ID)
    steps = run_to_completion(make_scheduler(async_scheduling=async_scheduling), [request])
    (prefill,) = steps[0].scheduled_requests
    assert (prefill.num_computed_tokens, prefill.num_new_tokens, prefill.is_decode) == (0, 1, False)
    assert steps[0].num_decodes == 0 and not steps[0].is_uniform_decode
    decodes = [step.scheduled_requests[0] for step in steps[1:]]
    assert [(d.num_computed_tokens, d.is_decode) for d in decodes] == [(1, True), (2, True)]
    assert all(step.is_uniform_decode for step in steps[1:])
    assert request.output_token_ids == reference_output(request)[0]
