"""The scheduler verifies a decode's proposals: lookahead KV slots, rollback, stops, stats.

Proves, with no model: a decoding request carrying proposals is scheduled for 1 + s tokens
(its proposals last in ``new_token_ids``), with KV blocks for all of them; proposals are cut to
the token budget and to ``max_tokens``; after the update, ``num_computed_tokens`` counts only
its own token and the accepted proposals, and the produced tokens are appended; a stop token
inside the accepted run ends the request there, the run's later tokens dropped; the output's
``uniform_decode_query_len`` tells a uniform verify batch from a mixed one; the acceptance
statistics add up.

Run: ``pytest tests/scheduler/test_spec_decode.py -q``
"""

from __future__ import annotations

from pieceworks.config import CacheConfig, SchedulerConfig
from pieceworks.sampling_params import SamplingParams
from pieceworks.scheduler.output import REJECTED_TOKEN_ID as X
from pieceworks.scheduler.request import Request
from pieceworks.scheduler.scheduler import Scheduler


def decoding(scheduler: Scheduler, request_id: str, prompt_len: int, **params) -> Request:
    """A request admitted, prefilled and given its first token: a decode from now on."""
    first = ord(request_id[0])  # prompts that share no prefix (no prefix-cache hits)
    request = Request(request_id, list(range(first, first + prompt_len)), SamplingParams(**params))
    scheduler.add_request(request)
    output = scheduler.schedule()
    scheduler.update_from_output(output, [100] * len(output.producing_requests))
    return request


def make_scheduler(max_num_batched_tokens: int = 64) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=max_num_batched_tokens)
    return Scheduler(config, CacheConfig(block_size=4), max_model_len=64, num_blocks=32)


def test_proposals_get_kv_slots_and_rejected_ones_roll_back():
    scheduler = make_scheduler()
    request = decoding(scheduler, "a", 6, max_tokens=20)
    request.spec_token_ids = [7, 8, 9]
    output = scheduler.schedule()
    (item,) = output.scheduled_requests
    assert item.num_new_tokens == 4 and item.new_token_ids == [100, 7, 8, 9]
    assert item.is_decode and output.uniform_decode_query_len == 4
    assert output.num_verify_columns == 4
    assert len(request.block_ids) * 4 >= 6 + 1 + 3  # positions 0 .. 9 have KV slots
    # 7 accepted, 8 rejected: the target's token 5 follows
    scheduler.update_from_output(output, [7, 5, X, X])
    assert request.output_token_ids == [100, 7, 5]
    assert request.num_computed_tokens == 6 + 2  # the prompt, 100 and 7: 5 is uncomputed
    stats = scheduler.spec_decoding_stats
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (1, 3, 1)
    assert stats.mean_accepted_length == 2.0


def test_proposals_are_cut_to_the_budget_and_max_tokens():
    scheduler = make_scheduler(max_num_batched_tokens=8)
    near_end = decoding(scheduler, "a", 3, max_tokens=4)
    other = decoding(scheduler, "b", 3, max_tokens=20)  # a decodes meanwhile: two left
    near_end.spec_token_ids = [1, 2, 3]
    other.spec_token_ids = [4, 5, 6, 7, 8, 9]
    output = scheduler.schedule()
    assert [item.spec_token_ids for item in output.scheduled_requests] == [[1], [4, 5, 6, 7, 8]]
    assert output.num_scheduled_tokens == 8 and output.uniform_decode_query_len == 0
    scheduler.update_from_output(output, [1, 2, X, X, X, X, 4, 5, 6, 7, 8, 11])
    assert near_end.is_finished and near_end.output_token_ids == [100, 100, 1, 2]
    assert other.output_token_ids == [100, 4, 5, 6, 7, 8, 11]


def test_a_stop_token_inside_an_accepted_run_ends_the_request_there():
    scheduler = make_scheduler()
    request = decoding(scheduler, "a", 5, max_tokens=20, stop_token_ids=[8])
    request.spec_token_ids = [7, 8, 9]
    output = scheduler.schedule()
    finished = scheduler.update_from_output(output, [7, 8, 9, 10])
    assert finished == [request] and request.finish_reason == "stop"
    assert request.output_token_ids == [100, 7, 8]
    assert scheduler.block_manager.num_free_blocks == 32


def test_proposals_are_dropped_rather_than_preempting_anyone():
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64)
    scheduler = Scheduler(config, CacheConfig(block_size=4), max_model_len=64, num_blocks=5)
    first = decoding(scheduler, "a", 7, max_tokens=8)  # positions 0-6: two blocks
    second = decoding(scheduler, "b", 7, max_tokens=8)  # two blocks; a fills its second
    second.spec_token_ids = [1, 2, 3]  # positions 8-10 need a block: a takes the last free
    output = scheduler.schedule()
    assert not output.preempted_requests and first.status == second.status
    assert [item.spec_token_ids for item in output.scheduled_requests] == [[], []]
