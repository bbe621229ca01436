"""KV blocks wholly before a sliding window go back to the pool while their request runs.

Proves: as one long request decodes, each step frees exactly the blocks whose every position is
before its first query's window (the pool count is exact at every step) and the block list keeps
its length, freed entries ``FREED_BLOCK_ID``; a fake model that reads only what the attention
kernels read (from the first query's window start on) never meets a freed entry; random
workloads, with a pool small enough to preempt and with async scheduling, give exactly the tokens
of the same scheduler without freeing and of a scheduler-free reference, and leak no block.

The fake model's next token is a hash of the last ``WINDOW`` tokens only, so a freed block that
were still needed, or a block handed to two requests, changes the tokens.
Run: pytest tests/scheduler/test_sliding_window_blocks.py
"""

from __future__ import annotations

import random

import pytest

from pieceworks.config import CacheConfig, SchedulerConfig
from pieceworks.sampling_params import SamplingParams
from pieceworks.scheduler.block_manager import BlockManager, cdiv
from pieceworks.scheduler.output import PLACEHOLDER_TOKEN_ID, SchedulerOutput
from pieceworks.scheduler.request import Request
from pieceworks.scheduler.scheduler import Scheduler
from tests.scheduler.test_scheduler import EOS_TOKEN_ID, VOCAB_SIZE, rolling_hash

WINDOW, BLOCK_SIZE = 6, 4
FREED = BlockManager.FREED_BLOCK_ID


def next_token(context: list[int]) -> int:
    """The fake sliding-window model: the last WINDOW tokens decide the next."""
    return rolling_hash(context[-WINDOW:]) % VOCAB_SIZE


def reference_tokens(request: Request) -> list[int]:
    token_ids, params = list(request.prompt_token_ids), request.sampling_params
    for _ in range(params.max_tokens):
        token_ids.append(next_token(token_ids))
    return token_ids[request.num_prompt_tokens :]


class WindowedRunner:
    """Writes each step's tokens into a paged 'KV cache' and reads back only the keys the step's
    first query can see, through ``block_ids``, failing on a freed entry."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.kv_cache = [-1] * scheduler.block_manager.num_tokens_capacity
        self.last_sampled: dict[str, int] = {}

    def slot(self, request: Request, position: int) -> int:
        block = request.block_ids[position // BLOCK_SIZE]
        assert block != FREED, f"{request.request_id} read position {position} of a freed block"
        return block * BLOCK_SIZE + position % BLOCK_SIZE

    def execute(self, output: SchedulerOutput) -> list[int]:
        for item in output.scheduled_requests:
            for offset, token_id in enumerate(item.new_token_ids):
                if token_id == PLACEHOLDER_TOKEN_ID:  # still on the "device" (async)
                    token_id = self.last_sampled[item.request.request_id]
                self.kv_cache[self.slot(item.request, item.num_computed_tokens + offset)] = token_id
        sampled, self.last_sampled = [], {}
        for item in output.scheduled_requests:
            end = item.num_computed_tokens + item.num_new_tokens
            first_visible = max(item.num_computed_tokens - WINDOW + 1, 0)
            context = [self.kv_cache[self.slot(item.request, p)] for p in range(first_visible, end)]
            if item.produces_token:
                sampled.append(next_token(context))
                self.last_sampled[item.request.request_id] = sampled[-1]
        return sampled


def make_scheduler(num_blocks: int, sliding_window: int | None, async_scheduling=False):
    return Scheduler(
        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16),
        CacheConfig(block_size=BLOCK_SIZE),
        max_model_len=256,
        num_blocks=num_blocks,
        async_scheduling=async_scheduling,
        sliding_window=sliding_window,
    )


def run(scheduler: Scheduler, requests: list[Request], after_schedule=lambda output: None):
    """Schedule, run, update until done (async: step N+1 runs before step N's update)."""
    runner = WindowedRunner(scheduler)
    for request in requests:
        scheduler.add_request(request)
    in_flight, num_preempted = None, 0
    while scheduler.has_unfinished_requests() or in_flight is not None:
        output = scheduler.schedule()
        after_schedule(output)
        num_preempted += len(output.preempted_requests)
        launched = (output, runner.execute(output)) if output.scheduled_requests else None
        if in_flight is not None:
            scheduler.update_from_output(*in_flight)
        in_flight = launched
        if scheduler.max_pending_outputs == 1 and in_flight is not None:
            scheduler.update_from_output(*in_flight)
            in_flight = None
    manager = scheduler.block_manager
    assert sorted(manager.free_block_ids) == list(range(manager.num_blocks)), "a block leaked"
    return num_preempted


def test_blocks_before_the_window_are_freed_as_a_long_request_decodes():
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    request = Request("long", list(range(1, 11)), params, eos_token_id=EOS_TOKEN_ID)
    scheduler = make_scheduler(num_blocks=32, sliding_window=WINDOW)
    manager, steps = scheduler.block_manager, []

    def check(output: SchedulerOutput) -> None:
        if not output.scheduled_requests:
            return
        item = output.scheduled_requests[0]
        first_query = item.num_computed_tokens
        end = first_query + item.num_new_tokens
        num_dead = max(first_query - WINDOW + 1, 0) // BLOCK_SIZE
        assert len(request.block_ids) == cdiv(end, BLOCK_SIZE)  # placeholders keep the length
        assert request.block_ids[:num_dead] == [FREED] * num_dead
        assert FREED not in request.block_ids[num_dead:]
        assert manager.num_free_blocks == 32 - (cdiv(end, BLOCK_SIZE) - num_dead)
        steps.append((num_dead, cdiv(end, BLOCK_SIZE) - num_dead))

    run(scheduler, [request], check)
    assert request.output_token_ids == reference_tokens(request)
    # 10 prompt tokens + 39 fed back: the last step's query is position 48, its window 43..48.
    assert steps[-1][0] == (48 - WINDOW + 1) // BLOCK_SIZE == 10
    # Held at once: at most the blocks a window of 6 and the step's token can touch, 3 of 4
    # slots (from position 43 in block 10 to position 48 in block 12), against 13 without it.
    assert max(live for _, live in steps) == 3


def random_requests(seed: int, num_requests: int, max_tokens: int) -> list[Request]:
    rng = random.Random(seed)
    return [
        Request(
            f"req-{index}",
            [rng.randrange(1, VOCAB_SIZE) for _ in range(rng.randint(1, 30))],
            SamplingParams(temperature=0.0, max_tokens=rng.randint(1, max_tokens), ignore_eos=True),
            eos_token_id=EOS_TOKEN_ID,
        )
        for index in range(num_requests)
    ]


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("seed", [1, 3, 7])  # workloads that preempt, sync and async alike
def test_tokens_equal_the_run_without_freeing_under_preemption(seed, async_scheduling):
    """10 blocks of 4: any one request fits (<= 30 + 10 - 1 tokens), four at once do not."""
    freeing, plain = random_requests(seed, 12, 10), random_requests(seed, 12, 10)
    run(make_scheduler(64, None), plain)
    tiny = make_scheduler(10, WINDOW, async_scheduling)
    num_preempted = run(tiny, freeing)
    assert num_preempted > 0
    for request, without in zip(freeing, plain, strict=True):
        assert request.output_token_ids == without.output_token_ids == reference_tokens(request)


def test_freeing_lets_more_run_at_once_than_without():
    """With the window, long decodes hold a bounded number of blocks: fewer preemptions."""
    counts = []
    for window in (None, WINDOW):
        requests = random_requests(0, 12, 25)
        counts.append(run(make_scheduler(14, window), requests))
    assert counts[1] < counts[0]
