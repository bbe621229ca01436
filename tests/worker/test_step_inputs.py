"""``StepInputs``: the same step values as a straightforward construction, updated in place.

Proves that (1) ``prepare`` puts exactly the values of a straightforward per-request construction
(``tests/worker/step_builders.py``, loop by loop) into the device fields, for a mixed step with
padding, state slots and a chunk that samples nothing, and again for a smaller step after it (no
stale rows leak into what the step reads); ``prepare_dummy`` likewise; (2) the rows to sample are
a view of the hidden states in a decode-only step and a gather otherwise, and the decodes' tokens
still on the device are filled from the previous step's sampled ids, in order, shuffled or alone;
one the previous step did not sample is refused with a message naming the request; (3) a staging
buffer updated in place (a step laid out like its last one, new block ids appended to a row, a
row taken by another request or a new block list, a steady async decode with every token still
on the device) gives the forward what a fresh buffer would, and ``reset_staged`` makes the next
steps write every field; (4) a fresh buffer has nothing to sample, fill in or advance, and dummy
steps after real ones read no real block.
Run: pytest tests/worker/test_step_inputs.py
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pieceworks.scheduler.output import PLACEHOLDER_TOKEN_ID, ScheduledRequest
from pieceworks.worker.input_buffers import StepShape
from pieceworks.worker.step_inputs import StepInputs
from tests.worker.step_builders import (
    BLOCK_SIZE,
    MAX_BLOCKS_PER_SEQ,
    MAX_NUM_SEQS,
    assert_step_matches,
    make_inputs,
    mixed_step,
    scheduled_request,
)


@pytest.mark.usefixtures("copy_gap")
def test_prepare_matches_reference_then_a_smaller_step():
    inputs = make_inputs()
    scheduled, shape = mixed_step()
    assert_step_matches(inputs, scheduled, shape)
    decodes = [
        scheduled_request(3, 1, 3, 1, first_block=40),
        scheduled_request(2, 4, 5, 1, first_block=50),
    ]
    assert_step_matches(inputs, decodes, StepShape(2, 4, 2, 4, 1))
    # One sequence, unpadded: each per-sequence field is a single row (a 1-byte bool included).
    first_chunk = [scheduled_request(6, 0, 0, 3, first_block=60, slot=2)]
    assert_step_matches(inputs, first_chunk, StepShape(3, 3, 1, 1, 3))
    chunk = [scheduled_request(6, 0, 1, 3, first_block=60, slot=2)]  # resumes at position 1
    assert_step_matches(inputs, chunk, StepShape(3, 4, 1, 2, 3))


@pytest.mark.usefixtures("copy_gap")
def test_prepare_dummy_values():
    inputs = make_inputs()
    assert_step_matches(inputs, *mixed_step())  # leave real values behind
    metadata = inputs.prepare_dummy(StepShape(7, 8, 3, 4, 3))
    assert metadata.query_start_loc.tolist() == [0, 3, 5, 7, 7]
    assert metadata.seq_lens.tolist() == [3, 2, 2, 0]
    assert metadata.slot_mapping.tolist() == [-1] * 8  # a dummy run writes no cache slot
    assert metadata.block_tables.eq(0).all() and metadata.state_indices.eq(0).all()
    assert not metadata.has_initial_state.any()
    assert [t.tolist() for t in inputs.model_inputs(StepShape(7, 8, 3, 4, 3))] == [[0] * 8] * 2
    # Nothing of the real step is left to sample or to fill in: no logits rows, no placeholders,
    # and the sequences are prefills unless the caller asks for a uniform decode.
    assert metadata.num_decodes == 0 and inputs.num_logits == inputs.num_placeholders == 0
    assert inputs.logits_indices().tolist() == []
    decode = inputs.prepare_dummy(StepShape(3, 4, 3, 4, 1), uniform_decode=True)
    assert decode.num_decodes == 4 and decode.query_start_loc.tolist() == [0, 1, 2, 3, 3]
    full = inputs.prepare_dummy(
        StepShape(MAX_NUM_SEQS, MAX_NUM_SEQS, MAX_NUM_SEQS, MAX_NUM_SEQS, 1)
    )
    assert full.query_start_loc.tolist() == list(range(MAX_NUM_SEQS + 1))  # the largest batch


PREVIOUS_SAMPLED = torch.tensor([900, 901, 902, 903])  # the previous step's ids, on the "device"


def decode_step(inputs: StepInputs, sampled_rows: dict[str, int], prefill_first: bool = False):
    """One decode per ``sampled_rows`` entry (``r0``, ``r10``, ...) whose token is still on the
    device (a placeholder), optionally behind a prefill chunk that samples nothing; returns the
    scheduled requests and the step's shape."""
    scheduled = []
    for i in range(len(sampled_rows)):  # 4 prompt tokens, 1 known output token, 1 on the device
        request = scheduled_request(4, 1, 0, 1, 10 * i).request
        request.num_computed_tokens, request.num_output_placeholders = 5, 1
        scheduled.append(ScheduledRequest(request, 1))
        assert scheduled[-1].new_token_ids == [PLACEHOLDER_TOKEN_ID]
    if prefill_first:
        scheduled.insert(0, scheduled_request(9, 0, 0, 4, 50))  # 4 of 9 prompt tokens: no token
    num_tokens = sum(item.num_new_tokens for item in scheduled)
    shape = StepShape(num_tokens, num_tokens, len(scheduled), len(scheduled), 4)
    inputs.prepare(scheduled, shape, sampled_rows, sampled=PREVIOUS_SAMPLED)
    return scheduled, shape


@pytest.mark.parametrize("prefill_first", [False, True])
def test_logits_rows_view_the_first_rows_of_a_decode_step_else_gather(prefill_first):
    inputs = make_inputs()
    scheduled, shape = decode_step(inputs, {f"r{10 * i}": i for i in range(3)}, prefill_first)
    hidden_states = torch.randn(shape.num_tokens_padded, 5)
    rows = inputs.logits_rows(hidden_states)
    # The last token of each request that samples: the decodes' rows, after the chunk's 4 if any.
    expected = [4, 5, 6] if prefill_first else [0, 1, 2]
    assert torch.equal(rows, hidden_states[expected])
    assert inputs.logits_indices().tolist() == expected
    # A decode-only step reads the rows in place (no gather kernel); otherwise they are copied.
    assert (rows.data_ptr() == hidden_states.data_ptr()) is not prefill_first


@pytest.mark.parametrize(
    "sampled_rows,prefill_first",
    [
        ({"r0": 0, "r10": 1, "r20": 2}, False),  # in order: one slice copy
        ({"r0": 1, "r10": 2, "r20": 3}, True),  # in order from row 1, behind a chunk
        ({"r0": 2, "r10": 0, "r20": 1}, False),  # shuffled: the indexed copy
        ({"r0": 2}, False),  # a single pending decode: a one-row slice copy
        ({"r0": 0}, True),
    ],
)
@pytest.mark.usefixtures("copy_gap")
def test_fill_placeholders_writes_each_decode_its_sampled_id(sampled_rows, prefill_first):
    inputs = make_inputs()
    scheduled, shape = decode_step(inputs, sampled_rows, prefill_first)  # fills from 900, ...
    input_ids, _ = inputs.model_inputs(shape)
    num_decodes = len(sampled_rows)
    decode_rows = [row + 4 * prefill_first for row in range(num_decodes)]
    expected = [900 + sampled_rows[item.request.request_id] for item in scheduled[-num_decodes:]]
    assert input_ids[decode_rows].tolist() == expected
    if prefill_first:  # the chunk's prompt tokens are untouched
        assert input_ids[:4].tolist() == scheduled[0].request.all_token_ids[:4]


def test_a_pending_token_the_previous_step_did_not_sample_is_refused():
    request = scheduled_request(4, 1, 0, 1, first_block=0).request
    request.num_computed_tokens, request.num_output_placeholders = 5, 1
    with pytest.raises(
        RuntimeError,
        match=r"request 'r0': its last token is still on the device but the previous step did "
        "not sample it; this is a scheduler/runner bug",
    ):
        make_inputs().prepare([ScheduledRequest(request, 1)], StepShape(1, 1, 1, 1, 1), {"r10": 0})


def decode_one_token(scheduled: list[ScheduledRequest]) -> list[ScheduledRequest]:
    """The next decode step of these requests: the token each sampled appended, one position on,
    a block appended to the same block-id list when the new position starts one."""
    next_step = []
    for item in scheduled:
        request = item.request
        request.output_token_ids.append(6000 + len(request.all_token_ids))
        request.num_computed_tokens = item.num_computed_tokens + item.num_new_tokens
        if request.num_tokens > len(request.block_ids) * BLOCK_SIZE:
            request.block_ids.append(request.block_ids[-1] + 1)  # appended in place
        next_step.append(ScheduledRequest(request, 1))
    return next_step


@pytest.mark.usefixtures("copy_gap")
def test_a_steady_decode_batch_updates_only_lengths_positions_slots_and_new_blocks():
    """Five decode steps of one batch, padded to 4 sequences, after its prefill step: steps 3, 4
    and 5 reuse the staging buffer of two steps back laid out the same way (the layout-only
    fields left as they are), and the block ids appended since (r0's new block at step 2, r10's
    and r20's at step 3) are added to their rows; every step reads what a fresh buffer would."""
    inputs = make_inputs()
    scheduled = [
        scheduled_request(3, 0, 0, 3, first_block=0, slot=2),
        scheduled_request(5, 1, 5, 1, first_block=10, slot=1),  # a decode already
        scheduled_request(2, 0, 0, 2, first_block=20),
    ]
    assert_step_matches(inputs, scheduled, StepShape(6, 8, 3, 4, 3))  # two prompts, a decode
    for _ in range(5):
        scheduled = decode_one_token(scheduled)
        assert_step_matches(inputs, scheduled, StepShape(3, 4, 3, 4, 1))
    assert [item.request.block_ids for item in scheduled] == [[0, 1], [10, 11, 12], [20, 21]]


@pytest.mark.usefixtures("copy_gap")
def test_a_row_taken_by_another_request_or_a_new_block_list_is_written_whole():
    """A block-table row rewritten where its request changed: a shorter list in a row that held
    a longer one (a request finished, the next moved up; or a preempted request back with new
    blocks, a new list), the stale ids past its end zeroed; and the row of a request that left a
    smaller batch zeroed as padding. Each pair of steps reaches the same staging buffer."""
    inputs = make_inputs()
    long = scheduled_request(12, 1, 12, 1, first_block=0)  # 4 blocks
    short = scheduled_request(2, 1, 2, 1, first_block=10)  # 1 block
    other = scheduled_request(6, 1, 6, 1, first_block=20)  # 2 blocks
    shape = StepShape(2, 2, 2, 2, 1)
    for _ in range(2):  # both staging buffers hold rows [long, short]
        assert_step_matches(inputs, [long, short], shape)
    assert_step_matches(inputs, [other, short], shape)  # row 0: 2 blocks where 4 were
    assert_step_matches(inputs, [other, short], shape)
    # The same request in row 0, its blocks freed and allocated again as a new, shorter list.
    other.request.block_ids, other.request.num_computed_tokens = [30], 2
    resumed = ScheduledRequest(other.request, 1)
    assert_step_matches(inputs, [resumed, short], shape)
    assert_step_matches(inputs, [resumed, short], shape)
    # One sequence padded to two: row 1, which held `short`, is padding now.
    assert_step_matches(inputs, [long], StepShape(1, 2, 1, 2, 1))
    assert_step_matches(inputs, [long], StepShape(1, 2, 1, 2, 1))


def async_decode_steps(scheduled: list[ScheduledRequest]) -> list[ScheduledRequest]:
    """The next async decode step: the host now knows the token sampled two steps back (the
    last step's is still on the device, a placeholder again), one position on."""
    next_step = []
    for item in scheduled:
        request = item.request
        request.output_token_ids.append(6000 + len(request.all_token_ids))
        request.num_computed_tokens = item.num_computed_tokens + 1
        if request.num_tokens > len(request.block_ids) * BLOCK_SIZE:
            request.block_ids.append(request.block_ids[-1] + 1)  # appended in place
        next_step.append(ScheduledRequest(request, 1))
    return next_step


@pytest.mark.parametrize("rows", [[0, 1, 2], [2, 0, 1]])
@pytest.mark.usefixtures("copy_gap")
def test_a_steady_async_decode_batch_fills_every_token_from_the_device(rows):
    """Every token of the step still on the device, the same layout as two steps back: the
    staged ids are not written again, and each decode still gets its own sampled id (one slice
    copy for rows in order, the indexed copy for shuffled ones), with positions, lengths, slots
    and new blocks of its step."""
    inputs = make_inputs()
    scheduled = []
    for first_block in (0, 10, 20):
        request = scheduled_request(4, 1, 0, 1, first_block, slot=first_block // 10 + 1).request
        request.num_computed_tokens, request.num_output_placeholders = 5, 1
        scheduled.append(ScheduledRequest(request, 1))
    sampled_rows = {item.request.request_id: row for item, row in zip(scheduled, rows)}
    for _ in range(5):  # positions 5 to 9: a second block from position 8
        assert_step_matches(inputs, scheduled, StepShape(3, 4, 3, 4, 1), sampled_rows)
        scheduled = async_decode_steps(scheduled)
    assert scheduled[0].request.block_ids == [0, 1, 2]


@pytest.mark.usefixtures("copy_gap")
def test_reset_staged_makes_the_next_steps_write_every_field_in_full():
    """After ``reset_staged`` each staging buffer's next step is written as into a fresh buffer,
    even laid out like its last step: here both staging buffers hold junk in every field first
    (what an in-place update would leave standing, block-table rows past their ids included)."""
    inputs = make_inputs()
    scheduled, shape = mixed_step()
    for _ in range(2):
        assert_step_matches(inputs, scheduled, shape)
    for views in inputs.buffers.staging_views:
        for view in views.values():
            view[...] = 77
    inputs.reset_staged()
    for _ in range(2):
        assert_step_matches(inputs, scheduled, shape)


def decode(first_block: int, on_device: bool = False, slot: int | None = None) -> ScheduledRequest:
    """A decode at position 5 (4 prompt tokens, 1 generated before); its token is still on the
    device when ``on_device``."""
    item = scheduled_request(4, 1 + (not on_device), 5, 1, first_block, slot)
    if on_device:
        item.request.num_output_placeholders = 1
        item = ScheduledRequest(item.request, 1)
    return item


LAYOUT_CHANGES = {  # name: the base step (requests, shape) -> (requests, shape, sampled rows)
    "padded tokens": lambda scheduled, shape: (
        scheduled,
        dataclasses.replace(shape, num_tokens_padded=12),
        None,
    ),
    "padded sequences": lambda scheduled, shape: (
        scheduled,
        dataclasses.replace(shape, num_seqs_padded=6),
        None,
    ),
    "state slots": lambda scheduled, shape: ([decode(0, slot=5), *scheduled[1:]], shape, None),
    "a chunk that samples": lambda scheduled, shape: (
        [*scheduled[:2], scheduled_request(4, 0, 0, 4, first_block=20, slot=3)],
        shape,
        None,
    ),
    "a token on the device": lambda scheduled, shape: (
        [decode(0, on_device=True, slot=1), *scheduled[1:]],
        shape,
        {"r0": 0},
    ),
}


@pytest.mark.parametrize("change", list(LAYOUT_CHANGES))
@pytest.mark.usefixtures("copy_gap")
def test_a_step_laid_out_unlike_the_buffers_last_step_writes_the_layout_fields(change):
    """The same requests with the same query lengths as the staging buffer's last step, with one
    thing the layout-only fields follow from changed: they are written again, and the step reads
    what a fresh buffer would."""
    scheduled = [decode(0, slot=1), decode(10, slot=2), scheduled_request(8, 0, 0, 4, 20, slot=3)]
    shape = StepShape(6, 8, 3, 4, 4)
    inputs = make_inputs()
    for _ in range(2):  # both staging buffers hold the base step
        assert_step_matches(inputs, scheduled, shape)
    assert_step_matches(inputs, *LAYOUT_CHANGES[change](scheduled, shape))


@pytest.mark.parametrize("rows", [{"r0": 0, "r10": 1}, {"r0": 1, "r10": 0}])
@pytest.mark.usefixtures("copy_gap")
def test_placeholder_rows_unlike_the_buffers_last_step_are_staged_again(rows):
    """Two decodes with their tokens on the device, laid out like the buffer's last step but for
    the rows of the sampled ids they take (swapped, or in order after swapped): each still gets
    its own id."""
    scheduled = [decode(0, on_device=True), decode(10, on_device=True)]
    shape = StepShape(2, 2, 2, 2, 1)
    inputs = make_inputs()
    other = {"r0": rows["r10"], "r10": rows["r0"]}
    for _ in range(2):
        assert_step_matches(inputs, scheduled, shape, other)
    assert_step_matches(inputs, scheduled, shape, rows)


def test_a_fresh_buffer_has_nothing_to_sample_fill_in_or_advance():
    """Before any ``prepare``: no rows to sample, no tokens to fill in from the device, and no
    later step staged (``advance_decode`` refuses step 1)."""
    inputs = make_inputs(max_num_steps=4)
    assert inputs.logits_indices().tolist() == [] and inputs.num_logits == 0
    assert inputs.num_placeholders == 0
    with pytest.raises(ValueError, match="prepare\\(\\) staged slots for 0 later steps"):
        inputs.advance_decode(torch.tensor([7]), 1)


def test_a_dummy_step_after_real_steps_on_both_staging_buffers_reads_no_real_block():
    """Real steps leave block ids in every row of both staging buffers; the dummy steps that
    follow on each read only zero block tables, no real step's values."""
    inputs = make_inputs()
    scheduled, shape = mixed_step()
    for _ in range(2):
        assert_step_matches(inputs, scheduled, shape)
    for _ in range(2):
        metadata = inputs.prepare_dummy(StepShape(4, 4, 4, 4, 1), uniform_decode=True)
        assert metadata.block_tables.tolist() == [[0] * MAX_BLOCKS_PER_SEQ] * 4
        assert metadata.seq_lens.tolist() == [1] * 4 and metadata.state_indices.tolist() == [0] * 4
