"""Prefix caching in the block manager and the scheduler, on the fake model of ``test_scheduler``.

Proves: a block hash is chained over its parent's hash, its tokens and its extra keys, and is
computed incrementally as tokens (prompt and generated) fill blocks; a finished request's full
blocks stay cached with no reference and a later request starting with the same tokens takes
them (reference counts add up while shared); a prompt that is wholly cached still computes its
last block, so its last token has logits; new blocks come from never-used blocks first, then
cached ones least recently used first (a request's tail before its head), and eviction forgets the
hash; only the KV of steps already launched is found (a request admitted beside the one still
computing a shared prefix recomputes it); a request asking for prompt_logprobs finds nothing; a
failed step's blocks are never found; a model with Mamba state slots turns prefix caching off with
one log line; random shared-prefix workloads (with preemption, sync and async) give the reference
tokens with every block back in the free queue when idle, and the hit counters count them.

Run: pytest tests/scheduler/test_prefix_cache.py
"""

from __future__ import annotations

import logging
import random

import pytest

from pieceworks.sampling_params import SamplingParams
from pieceworks.scheduler.block_hash import hash_block_tokens, root_block_hash, update_block_hashes
from pieceworks.scheduler.block_manager import BlockManager
from pieceworks.scheduler.request import Request, RequestStatus
from tests.scheduler.test_scheduler import (
    EOS_TOKEN_ID,
    FakeModelRunner,
    check_matches_reference,
    check_no_leaks,
    make_scheduler,
    run_to_completion,
)

PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def computed(manager: BlockManager, request: Request, num_tokens: int) -> Request:
    """Give ``request`` blocks for ``num_tokens`` computed tokens and register them."""
    assert manager.allocate(request, num_tokens)
    request.num_computed_tokens = num_tokens
    manager.cache_computed_blocks(request)
    return request


def test_block_hashes_are_chained_and_computed_as_blocks_fill():
    root = root_block_hash("model-a")
    assert root != root_block_hash("model-b")  # two models' caches never mix
    first = hash_block_tokens(root, [1, 2, 3, 4])
    assert first == hash_block_tokens(root, [1, 2, 3, 4])
    assert first != hash_block_tokens(root_block_hash("model-b"), [1, 2, 3, 4])
    assert first != hash_block_tokens(root, [1, 2, 3, 5])
    assert first != hash_block_tokens(root, [1, 2, 3, 4], extra_keys=("lora-1",))
    second = hash_block_tokens(first, [5, 6, 7, 8])
    assert second != hash_block_tokens(root, [5, 6, 7, 8])  # the same tokens after another prefix
    request = Request("r", [1, 2, 3, 4, 5, 6])
    update_block_hashes(request, 4, root)
    assert request.block_hashes == [first]  # the second block is not full yet
    request.output_token_ids += [7, 8, 9]
    update_block_hashes(request, 4, root)
    assert request.block_hashes == [first, second]  # generated tokens fill blocks too
    request.drop_output_after(1)  # a stop string: the hashes are recomputed when needed
    update_block_hashes(request, 4, root)
    assert request.block_hashes == [first]


def test_a_finished_requests_blocks_are_reused_and_reference_counted():
    manager = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    first = computed(manager, Request("a", list(range(10))), 10)  # 2 full blocks + 2 tokens
    held = list(first.block_ids)
    manager.free(first)
    assert manager.num_free_blocks == 8 and manager.num_cached_blocks == 2
    later = Request("b", list(range(8)) + [50, 51, 52])
    hits = manager.get_computed_blocks(later)
    assert hits == held[:2]
    assert manager.allocate(later, later.num_tokens - 8, hits)
    assert later.block_ids[:2] == held[:2] and len(later.block_ids) == 3
    sharing = Request("c", list(range(8)) + [60])
    assert manager.allocate(sharing, 1, manager.get_computed_blocks(sharing))
    assert [manager.ref_counts[b] for b in held[:2]] == [2, 2]
    assert manager.num_free_blocks == 8 - 4  # 2 shared + 1 + 1 of their own
    manager.free(later)
    manager.free(sharing)
    assert manager.num_free_blocks == 8 and not any(manager.ref_counts)


def test_a_wholly_cached_prompt_still_computes_its_last_block():
    scheduler = make_scheduler()
    runner = FakeModelRunner(scheduler)
    first = Request("a", list(range(1, 13)), PARAMS, EOS_TOKEN_ID)  # 3 full blocks of 4
    again = Request("b", list(range(1, 13)), PARAMS, EOS_TOKEN_ID)
    for request in (first, again):
        scheduler.add_request(request)
        steps = []
        while scheduler.has_unfinished_requests():
            steps.append(scheduler.schedule())
            scheduler.update_from_output(steps[-1], runner.execute(steps[-1]))
    (item,) = steps[0].scheduled_requests
    # 2 of its 3 blocks come from the cache; the last (its last token's) is computed anew.
    assert (item.num_computed_tokens, item.num_new_tokens, item.produces_token) == (8, 4, True)
    assert again.output_token_ids == first.output_token_ids
    check_no_leaks(scheduler)


def test_eviction_takes_never_used_blocks_first_then_the_least_recently_used():
    manager = BlockManager(num_blocks=6, block_size=2, enable_prefix_caching=True)
    old = computed(manager, Request("old", [1, 2, 3, 4]), 4)  # blocks 0, 1
    new = computed(manager, Request("new", [5, 6, 7, 8]), 4)  # blocks 2, 3
    manager.free(old)
    manager.free(new)
    # Never used (4, 5), then old's tail and head, then new's tail and head.
    assert manager.free_block_ids == [4, 5, 1, 0, 3, 2]
    taker = Request("taker", [9] * 6)
    assert manager.allocate(taker, 6) and taker.block_ids == [4, 5, 1]
    assert manager.num_cached_blocks == 3  # old's tail was evicted: its hash is gone
    assert manager.get_computed_blocks(Request("x", [1, 2, 3, 4, 0])) == [0]
    reused = Request("y", [5, 6, 7, 8, 0])
    hits = manager.get_computed_blocks(reused)
    assert hits == [2, 3] and manager.allocate(reused, 1, hits)  # its third block evicts 0
    assert reused.block_ids == [2, 3, 0] and not manager.free_block_ids
    assert manager.get_computed_blocks(Request("x", [1, 2, 3, 4, 0])) == []


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_only_the_kv_of_launched_steps_is_found(async_scheduling):
    scheduler = make_scheduler(max_num_batched_tokens=32, async_scheduling=async_scheduling)
    prefix = list(range(1, 13))
    first = Request("a", prefix + [20, 21, 22], PARAMS)
    beside = Request("b", prefix + [30], PARAMS)
    scheduler.add_request(first)
    scheduler.add_request(beside)
    output = scheduler.schedule()  # both admitted at once: neither finds the other's blocks
    assert [item.num_computed_tokens for item in output.scheduled_requests] == [0, 0]
    assert scheduler.block_manager.num_prefix_cache_hits == 0
    scheduler.update_from_output(output, [0] * output.num_requests)
    later = Request("c", prefix + [40], PARAMS)
    scheduler.add_request(later)
    output = scheduler.schedule()
    assert output.scheduled_requests[-1].num_computed_tokens == 12


def test_prompt_logprobs_requests_compute_their_whole_prompt():
    scheduler = make_scheduler()
    run_to_completion(scheduler, [Request("a", list(range(1, 13)), PARAMS)])
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=1)
    scheduler.add_request(Request("b", list(range(1, 13)), params))
    (item,) = scheduler.schedule().scheduled_requests
    assert (item.num_computed_tokens, item.num_new_tokens) == (0, 12)


def test_a_failed_steps_blocks_are_never_found():
    scheduler = make_scheduler(async_scheduling=True)
    request = Request("a", list(range(1, 13)), PARAMS)
    scheduler.add_request(request)
    scheduler.schedule()
    scheduler.schedule()  # registers the first step's blocks, launches a second
    assert scheduler.block_manager.num_cached_blocks == 3
    for output in scheduler.drop_pending_outputs():
        requests = [item.request.request_id for item in output.scheduled_requests]
        scheduler.finish_requests(requests, RequestStatus.FINISHED_ABORTED)
    manager = scheduler.block_manager
    assert manager.num_cached_blocks == 0 and manager.num_free_blocks == manager.num_blocks


def test_hybrid_models_turn_prefix_caching_off_with_a_log_line(caplog):
    with caplog.at_level(logging.INFO, logger="pieceworks"):
        scheduler = make_scheduler(num_state_slots=3)
    assert not scheduler.block_manager.enable_prefix_caching
    lines = [r.getMessage() for r in caplog.records if "prefix caching is off" in r.getMessage()]
    assert len(lines) == 1 and "Mamba" in lines[0]


def shared_prefix_requests(seed: int, num_requests: int) -> list[Request]:
    """Prompts from a few shared prefixes (some of them each other's prefixes) plus a tail."""
    rng = random.Random(seed)
    base = [rng.randrange(1, 48) for _ in range(24)]
    prefixes = [base[:8], base[:13], base[:20], [rng.randrange(1, 48) for _ in range(9)]]
    requests = []
    for index in range(num_requests):
        prompt = rng.choice(prefixes) + [rng.randrange(1, 48) for _ in range(rng.randrange(0, 6))]
        params = SamplingParams(temperature=0.0, max_tokens=rng.randrange(1, 12))
        requests.append(Request(f"r{index}", prompt, params, EOS_TOKEN_ID))
    return requests


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("num_blocks", [256, 9])
@pytest.mark.parametrize("seed", range(2))
def test_shared_prefix_workloads_give_the_reference_tokens(seed, num_blocks, async_scheduling):
    """9 blocks of 4 hold any one request (<= 25 + 11 KV tokens) but not many: preemption."""
    requests = shared_prefix_requests(seed, num_requests=24)
    scheduler = make_scheduler(
        max_num_batched_tokens=24, num_blocks=num_blocks, async_scheduling=async_scheduling
    )
    outputs = run_to_completion(scheduler, requests)  # checks that every block is free again
    check_matches_reference(requests)
    manager = scheduler.block_manager
    assert 0 < manager.num_prefix_cache_hits < manager.num_prefix_cache_queries
    if num_blocks == 9:
        assert any(output.preempted_requests for output in outputs)
    off = make_scheduler(
        max_num_batched_tokens=24,
        num_blocks=num_blocks,
        async_scheduling=async_scheduling,
        enable_prefix_caching=False,
    )
    plain = shared_prefix_requests(seed, num_requests=24)
    run_to_completion(off, plain)
    assert [r.output_token_ids for r in plain] == [r.output_token_ids for r in requests]
    assert off.block_manager.num_prefix_cache_queries == 0
    assert off.block_manager.num_cached_blocks == 0
