"""``InputBuffers`` with packed fields: the same step values, fixed addresses, few copies.

Proves that (1) ``prepare`` puts exactly the values of a straightforward per-request construction
(written out below, loop by loop) into the device fields, for a mixed step with padding, state
slots and a chunk that samples nothing, and again for a smaller step after it (no stale rows
leak into what the step reads); ``prepare_dummy`` likewise; (2) every metadata tensor and model
input of a padded shape has the same address on every step of that shape (a captured graph reads
them there); (3) a step's copies cover every used byte of every field, one copy at the default
sizes and more only across gaps of at least ``MAX_COPY_GAP_BYTES``; (4) the rows to sample are a
view of the hidden states in a decode-only step and a gather otherwise, and the decodes' tokens
still on the device are filled from the previous step's sampled ids, in order, shuffled or
alone; one the previous step did not sample is refused with a message naming the request; (5)
the two staging buffers alternate and a step waits only on the copy two steps back; (6) each
later step of a multi-step decode run, made on the device by ``advance_decode``, holds that
step's values; (7) a staging buffer updated in place (a step laid out like its last one, new
block ids appended to a row, a row taken by another request or a new block list, a steady async
decode with every token still on the device) gives the forward what a fresh buffer would, and
``reset_staged`` makes the next steps write every field; (8) a fresh buffer has nothing to
sample, fill in or advance, and dummy steps after real ones read no real block.

The "device" is the CPU here: device and staging buffers are still separate tensors, so a field
the copies missed would read stale values.
Run: pytest tests/worker/test_input_buffers.py
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import pytest
import torch

from pieceworks.scheduler.output import PLACEHOLDER_TOKEN_ID, ScheduledRequest
from pieceworks.scheduler.request import Request
from pieceworks.worker import input_buffers
from pieceworks.worker.input_buffers import MAX_COPY_GAP_BYTES, InputBuffers, StepShape

BLOCK_SIZE = 4
MAX_NUM_TOKENS, MAX_NUM_SEQS, MAX_BLOCKS_PER_SEQ = 64, 8, 16


def make_buffers(max_num_tokens: int = MAX_NUM_TOKENS, max_num_steps: int = 1) -> InputBuffers:
    return InputBuffers(
        max_num_tokens,
        MAX_NUM_SEQS,
        MAX_BLOCKS_PER_SEQ,
        torch.device("cpu"),
        pin_memory=False,
        max_num_steps=max_num_steps,
    )


def scheduled_request(
    prompt_len: int, num_output: int, num_computed: int, num_new: int, first_block: int, slot=None
) -> ScheduledRequest:
    """A request with distinct token ids and blocks [first_block, ...) covering its tokens."""
    num_tokens = prompt_len + num_output
    request = Request(
        f"r{first_block}",
        [1000 + first_block * 10 + i for i in range(prompt_len)],
        output_token_ids=[5000 + first_block * 10 + i for i in range(num_output)],
        num_computed_tokens=num_computed,
        block_ids=list(range(first_block, first_block + -(-num_tokens // BLOCK_SIZE))),
        state_slot=slot,
    )
    return ScheduledRequest(request, num_new)


def reference_step(
    scheduled: list[ScheduledRequest], shape: StepShape, on_device: Mapping[str, int] | None = None
) -> dict[str, list]:
    """What every field must hold for this step, built one request and one token at a time;
    ``on_device``: a request id -> the id the previous step sampled for it, still on the device."""
    expected: dict[str, list] = {name: [] for name in ("input_ids", "positions", "slot_mapping")}
    query_start_loc, block_tables = [0], []
    for item in scheduled:
        request, start = item.request, item.num_computed_tokens
        known = request.all_token_ids + [(on_device or {}).get(request.request_id)]
        for position in range(start, start + item.num_new_tokens):
            expected["input_ids"].append(known[position])
            expected["positions"].append(position)
            block = request.block_ids[position // BLOCK_SIZE]
            expected["slot_mapping"].append(block * BLOCK_SIZE + position % BLOCK_SIZE)
        query_start_loc.append(query_start_loc[-1] + item.num_new_tokens)
        row = request.block_ids + [0] * (MAX_BLOCKS_PER_SEQ - len(request.block_ids))
        block_tables.append(row)
    num_padded_tokens = shape.num_tokens_padded - shape.num_tokens
    num_padded_seqs = shape.num_seqs_padded - shape.num_seqs
    expected["input_ids"] += [0] * num_padded_tokens
    expected["positions"] += [0] * num_padded_tokens
    expected["slot_mapping"] += [-1] * num_padded_tokens  # padded tokens are never stored
    expected["query_start_loc"] = query_start_loc + [shape.num_tokens] * num_padded_seqs
    expected["seq_lens"] = [s.num_computed_tokens + s.num_new_tokens for s in scheduled]
    expected["seq_lens"] += [0] * num_padded_seqs
    expected["block_tables"] = block_tables + [[0] * MAX_BLOCKS_PER_SEQ] * num_padded_seqs
    expected["state_indices"] = [s.request.state_slot or 0 for s in scheduled]
    expected["state_indices"] += [0] * num_padded_seqs
    expected["has_initial_state"] = [s.num_computed_tokens > 0 for s in scheduled]
    expected["has_initial_state"] += [False] * num_padded_seqs
    expected["logits_indices"] = [
        query_start_loc[row + 1] - 1 for row, s in enumerate(scheduled) if s.produces_token
    ]
    return expected


DTYPES = {
    "input_ids": torch.int64,
    "positions": torch.int64,
    "slot_mapping": torch.int64,
    "logits_indices": torch.int64,
    "query_start_loc": torch.int32,
    "seq_lens": torch.int32,
    "block_tables": torch.int32,
    "state_indices": torch.int32,
    "has_initial_state": torch.bool,
}


def assert_step_matches(
    buffers: InputBuffers, scheduled, shape: StepShape, sampled_rows: dict[str, int] | None = None
) -> None:
    """``prepare`` the step and compare every field the forward reads with ``reference_step``;
    ``sampled_rows``: the decodes whose token is on the device, and their rows in the previous
    step's sampled ids (here 900, 901, ...), filled in by ``fill_placeholders``."""
    metadata = buffers.prepare(scheduled, shape, BLOCK_SIZE, sampled_rows)
    sampled = torch.arange(900, 900 + MAX_NUM_SEQS)
    buffers.fill_placeholders(sampled)
    input_ids, positions = buffers.model_inputs(shape)
    num_logits = sum(1 for s in scheduled if s.produces_token)
    actual = {
        "input_ids": input_ids,
        "positions": positions,
        "slot_mapping": metadata.slot_mapping,
        "query_start_loc": metadata.query_start_loc,
        "seq_lens": metadata.seq_lens,
        "block_tables": metadata.block_tables,
        "state_indices": metadata.state_indices,
        "has_initial_state": metadata.has_initial_state,
        "logits_indices": buffers.logits_indices(),
    }
    assert buffers.num_logits == num_logits
    on_device = {name: 900 + row for name, row in (sampled_rows or {}).items()}
    for name, expected in reference_step(scheduled, shape, on_device).items():
        assert actual[name].dtype == DTYPES[name], name
        assert actual[name].tolist() == expected, name
    assert metadata.num_actual_tokens == shape.num_tokens
    assert metadata.max_query_len == shape.max_query_len
    assert metadata.num_decodes == sum(1 for s in scheduled if s.is_decode)


def mixed_step() -> tuple[list[ScheduledRequest], StepShape]:
    scheduled = [
        scheduled_request(6, 3, 8, 1, first_block=0, slot=3),  # decode
        scheduled_request(9, 2, 10, 1, first_block=10, slot=1),  # decode
        scheduled_request(20, 0, 4, 8, first_block=20, slot=2),  # a chunk: samples nothing
        scheduled_request(5, 0, 0, 5, first_block=30, slot=4),  # a whole prompt
    ]
    return scheduled, StepShape(15, 18, 4, 6, 8)  # 3 padded tokens, 2 padded sequences


@pytest.fixture(params=["merged", "per_field"])
def copy_gap(request, monkeypatch):
    """Run twice: with the default merging, and with every field copied on its own (exactly
    its used rows), so a row count that is off by one cannot hide inside a merged copy."""
    if request.param == "per_field":
        monkeypatch.setattr(input_buffers, "MAX_COPY_GAP_BYTES", 0)


@pytest.mark.usefixtures("copy_gap")
def test_prepare_matches_reference_then_a_smaller_step():
    buffers = make_buffers()
    scheduled, shape = mixed_step()
    assert_step_matches(buffers, scheduled, shape)
    decodes = [
        scheduled_request(3, 1, 3, 1, first_block=40),
        scheduled_request(2, 4, 5, 1, first_block=50),
    ]
    assert_step_matches(buffers, decodes, StepShape(2, 4, 2, 4, 1))
    # One sequence, unpadded: each per-sequence field is a single row (a 1-byte bool included).
    first_chunk = [scheduled_request(6, 0, 0, 3, first_block=60, slot=2)]
    assert_step_matches(buffers, first_chunk, StepShape(3, 3, 1, 1, 3))
    chunk = [scheduled_request(6, 0, 1, 3, first_block=60, slot=2)]  # resumes at position 1
    assert_step_matches(buffers, chunk, StepShape(3, 4, 1, 2, 3))


@pytest.mark.usefixtures("copy_gap")
def test_prepare_dummy_values():
    buffers = make_buffers()
    assert_step_matches(buffers, *mixed_step())  # leave real values behind
    metadata = buffers.prepare_dummy(StepShape(7, 8, 3, 4, 3))
    assert metadata.query_start_loc.tolist() == [0, 3, 5, 7, 7]
    assert metadata.seq_lens.tolist() == [3, 2, 2, 0]
    assert metadata.slot_mapping.tolist() == [-1] * 8  # a dummy run writes no cache slot
    assert metadata.block_tables.eq(0).all() and metadata.state_indices.eq(0).all()
    assert not metadata.has_initial_state.any()
    assert [t.tolist() for t in buffers.model_inputs(StepShape(7, 8, 3, 4, 3))] == [[0] * 8] * 2
    # Nothing of the real step is left to sample or to fill in: no logits rows, no placeholders,
    # and the sequences are prefills unless the caller asks for a uniform decode.
    assert metadata.num_decodes == 0 and buffers.num_logits == buffers.num_placeholders == 0
    assert buffers.logits_indices().tolist() == []
    decode = buffers.prepare_dummy(StepShape(3, 4, 3, 4, 1), uniform_decode=True)
    assert decode.num_decodes == 4 and decode.query_start_loc.tolist() == [0, 1, 2, 3, 3]
    full = buffers.prepare_dummy(
        StepShape(MAX_NUM_SEQS, MAX_NUM_SEQS, MAX_NUM_SEQS, MAX_NUM_SEQS, 1)
    )
    assert full.query_start_loc.tolist() == list(range(MAX_NUM_SEQS + 1))  # the largest batch


def test_addresses_fixed_across_steps_of_one_padded_shape():
    buffers = make_buffers()
    shape = StepShape(3, 4, 3, 4, 1)

    def addresses(first_block: int) -> list[int]:
        scheduled = [scheduled_request(4, 2, 5, 1, first_block + 10 * i) for i in range(3)]
        metadata = buffers.prepare(scheduled, shape, BLOCK_SIZE)
        tensors = [
            *buffers.model_inputs(shape),
            metadata.query_start_loc,
            metadata.seq_lens,
            metadata.block_tables,
            metadata.slot_mapping,
            metadata.state_indices,
            metadata.has_initial_state,
            buffers.logits_indices(),
        ]
        return [tensor.data_ptr() for tensor in tensors]

    first = addresses(0)
    buffers.prepare_dummy(StepShape(9, 16, 5, 8, 2))  # another shape in between
    assert addresses(40) == first
    # Each is the start of its field: a prefix view, as a graph of any size expects.
    names = ["input_ids", "positions", "query_start_loc", "seq_lens", "block_tables",
             "slot_mapping", "state_indices", "has_initial_state", "logits_indices"]  # fmt: skip
    assert first == [buffers[name].data_ptr() for name in names]
    # The views themselves are made once per padded shape: a step builds no tensors for them.
    assert buffers.metadata(shape, 0).seq_lens is buffers.metadata(shape, 0).seq_lens


@pytest.mark.parametrize("max_num_tokens", [64, 2048, 16384])
@pytest.mark.parametrize("num_seqs,num_tokens", [(1, 1), (4, 4), (8, 64), (2, 40)])
def test_copies_cover_every_used_byte(max_num_tokens, num_seqs, num_tokens):
    buffers = make_buffers(max_num_tokens, max_num_steps=4)
    shape = StepShape(num_tokens, num_tokens, num_seqs, num_seqs, 1)
    ranges = buffers.copy_ranges(shape, num_logits=num_seqs, num_placeholders=num_seqs,
                                 num_step_slots=3 * num_seqs)  # fmt: skip
    rows = {"tokens": num_tokens, "seqs": num_seqs, "seqs+1": num_seqs + 1, "logits": num_seqs,
            "placeholders": num_seqs, "step_slots": 3 * num_seqs}  # fmt: skip
    for field in buffers.fields:
        start, end = field.offset, field.offset + rows[field.rows] * field.row_bytes
        assert any(lo <= start and end <= hi for lo, hi in ranges), field.name
    for (_, previous_end), (next_start, _) in zip(ranges, ranges[1:], strict=False):
        assert next_start - previous_end >= MAX_COPY_GAP_BYTES  # split only across large gaps


def test_one_copy_at_default_sizes():
    # llama-3.1-8b defaults: 2048 batched tokens, 128 sequences, 8192 / 16 blocks per sequence.
    buffers = InputBuffers(2048, 128, 512, torch.device("cpu"), pin_memory=False)
    assert buffers["step_slots"].numel() == 0  # one step per output unless max_num_steps says
    for num_seqs in (1, 8, 64, 128):
        shape = StepShape(num_seqs, num_seqs, num_seqs, num_seqs, 1)
        assert len(buffers.copy_ranges(shape, num_logits=num_seqs)) == 1


@pytest.mark.usefixtures("copy_gap")
def test_advance_decode_gives_each_later_step_of_a_multi_step_run():
    """Three decodes padded to 4 sequences (a FULL decode layout), run 4 steps: after each
    ``advance_decode`` the device fields hold that step (the sampled ids as inputs, positions and
    lengths one further, slots through the blocks reserved ahead, one step crossing into a new
    block), and the padded row stays inert."""
    buffers = make_buffers(max_num_steps=4)
    scheduled = []
    for prompt_len, first_block in [(3, 0), (6, 4), (9, 8)]:
        item = scheduled_request(prompt_len, 1, prompt_len, 1, first_block)
        # Blocks for the 3 later steps, reserved ahead: positions up to prompt_len + 3 (r0 goes
        # from position 3 in its first block to 4-6 in its second).
        item.request.block_ids = list(range(first_block, first_block + 4))
        scheduled.append(item)
    shape = StepShape(3, 4, 3, 4, 1)
    buffers.prepare(scheduled, shape, BLOCK_SIZE, num_steps=4)
    for step in range(1, 4):
        sampled = torch.tensor([70 + step, 80 + step, 90 + step])
        buffers.advance_decode(sampled, step)
        positions = [item.num_computed_tokens + step for item in scheduled]
        slots = [
            item.request.block_ids[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
            for item, p in zip(scheduled, positions)
        ]
        assert buffers["input_ids"][:4].tolist() == sampled.tolist() + [0]
        assert buffers["positions"][:4].tolist() == positions + [0]
        assert buffers["seq_lens"][:4].tolist() == [p + 1 for p in positions] + [0]
        assert buffers["slot_mapping"][:4].tolist() == slots + [-1]
    with pytest.raises(ValueError, match="step 4 of a run of 3 sequences: prepare\\(\\) staged"):
        buffers.advance_decode(sampled, 4)


def decode_step(buffers: InputBuffers, sampled_rows: dict[str, int], prefill_first: bool = False):
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
    buffers.prepare(scheduled, shape, BLOCK_SIZE, sampled_rows)
    return scheduled, shape


@pytest.mark.parametrize("prefill_first", [False, True])
def test_logits_rows_view_the_first_rows_of_a_decode_step_else_gather(prefill_first):
    buffers = make_buffers()
    scheduled, shape = decode_step(buffers, {f"r{10 * i}": i for i in range(3)}, prefill_first)
    hidden_states = torch.randn(shape.num_tokens_padded, 5)
    rows = buffers.logits_rows(hidden_states)
    # The last token of each request that samples: the decodes' rows, after the chunk's 4 if any.
    expected = [4, 5, 6] if prefill_first else [0, 1, 2]
    assert torch.equal(rows, hidden_states[expected])
    assert buffers.logits_indices().tolist() == expected
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
    buffers = make_buffers()
    scheduled, shape = decode_step(buffers, sampled_rows, prefill_first)
    sampled = torch.tensor([900, 901, 902, 903])  # the previous step's ids, on the "device"
    buffers.fill_placeholders(sampled)
    input_ids, _ = buffers.model_inputs(shape)
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
        make_buffers().prepare(
            [ScheduledRequest(request, 1)], StepShape(1, 1, 1, 1, 1), BLOCK_SIZE, {"r10": 0}
        )


class RecordingEvent:
    """Stands in for a device event: ``synchronize`` logs whether a copy was recorded on it."""

    def __init__(self, index: int, log: list[tuple[int, bool]]) -> None:
        self.index, self.log, self.recorded = index, log, False

    def record(self) -> None:
        self.recorded = True

    def synchronize(self) -> None:
        self.log.append((self.index, self.recorded))


def test_a_step_waits_for_the_copy_two_steps_back_never_the_last_one():
    """Two staging buffers alternate: before a step refills one, it waits on the event recorded
    after the copy that last read it (two steps back), so the previous step's copy may still run
    while the host prepares the next (no host sync on the step just launched)."""
    log: list[tuple[int, bool]] = []
    events: list[RecordingEvent] = []

    def create_event() -> RecordingEvent:
        events.append(RecordingEvent(len(events), log))
        return events[-1]

    buffers = InputBuffers(
        MAX_NUM_TOKENS, MAX_NUM_SEQS, MAX_BLOCKS_PER_SEQ, torch.device("cpu"), False, create_event
    )
    staging = []
    for step in range(4):
        if step % 2:
            buffers.prepare_dummy(StepShape(2, 2, 2, 2, 1))
        else:
            assert_step_matches(buffers, *mixed_step())
        staging.append(buffers.packed_host.data_ptr())
    # Steps 0 and 1 find fresh buffers; steps 2 and 3 wait on the copies of steps 0 and 1.
    assert log == [(0, False), (1, False), (0, True), (1, True)]
    assert staging[0] == staging[2] != staging[1] == staging[3]


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
    buffers = make_buffers()
    scheduled = [
        scheduled_request(3, 0, 0, 3, first_block=0, slot=2),
        scheduled_request(5, 1, 5, 1, first_block=10, slot=1),  # a decode already
        scheduled_request(2, 0, 0, 2, first_block=20),
    ]
    assert_step_matches(buffers, scheduled, StepShape(6, 8, 3, 4, 3))  # two prompts, a decode
    for _ in range(5):
        scheduled = decode_one_token(scheduled)
        assert_step_matches(buffers, scheduled, StepShape(3, 4, 3, 4, 1))
    assert [item.request.block_ids for item in scheduled] == [[0, 1], [10, 11, 12], [20, 21]]


@pytest.mark.usefixtures("copy_gap")
def test_a_row_taken_by_another_request_or_a_new_block_list_is_written_whole():
    """A block-table row rewritten where its request changed: a shorter list in a row that held
    a longer one (a request finished, the next moved up; or a preempted request back with new
    blocks, a new list), the stale ids past its end zeroed; and the row of a request that left a
    smaller batch zeroed as padding. Each pair of steps reaches the same staging buffer."""
    buffers = make_buffers()
    long = scheduled_request(12, 1, 12, 1, first_block=0)  # 4 blocks
    short = scheduled_request(2, 1, 2, 1, first_block=10)  # 1 block
    other = scheduled_request(6, 1, 6, 1, first_block=20)  # 2 blocks
    shape = StepShape(2, 2, 2, 2, 1)
    for _ in range(2):  # both staging buffers hold rows [long, short]
        assert_step_matches(buffers, [long, short], shape)
    assert_step_matches(buffers, [other, short], shape)  # row 0: 2 blocks where 4 were
    assert_step_matches(buffers, [other, short], shape)
    # The same request in row 0, its blocks freed and allocated again as a new, shorter list.
    other.request.block_ids, other.request.num_computed_tokens = [30], 2
    resumed = ScheduledRequest(other.request, 1)
    assert_step_matches(buffers, [resumed, short], shape)
    assert_step_matches(buffers, [resumed, short], shape)
    # One sequence padded to two: row 1, which held `short`, is padding now.
    assert_step_matches(buffers, [long], StepShape(1, 2, 1, 2, 1))
    assert_step_matches(buffers, [long], StepShape(1, 2, 1, 2, 1))


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
    buffers = make_buffers()
    scheduled = []
    for first_block in (0, 10, 20):
        request = scheduled_request(4, 1, 0, 1, first_block, slot=first_block // 10 + 1).request
        request.num_computed_tokens, request.num_output_placeholders = 5, 1
        scheduled.append(ScheduledRequest(request, 1))
    sampled_rows = {item.request.request_id: row for item, row in zip(scheduled, rows)}
    for _ in range(5):  # positions 5 to 9: a second block from position 8
        assert_step_matches(buffers, scheduled, StepShape(3, 4, 3, 4, 1), sampled_rows)
        scheduled = async_decode_steps(scheduled)
    assert scheduled[0].request.block_ids == [0, 1, 2]


@pytest.mark.usefixtures("copy_gap")
def test_advance_decode_of_one_sequence_and_the_steps_it_refuses():
    """One sequence run 3 steps: 2 later steps staged, each one position on; step 0 and step 3
    are refused with the count of staged steps (the message in full)."""
    buffers = make_buffers(max_num_steps=3)
    item = scheduled_request(5, 1, 5, 1, first_block=0)
    item.request.block_ids = [0, 1]  # positions 5, 6, 7: reserved ahead
    buffers.prepare([item], StepShape(1, 1, 1, 1, 1), BLOCK_SIZE, num_steps=3)
    for step in (1, 2):
        buffers.advance_decode(torch.tensor([70 + step]), step)
        assert buffers["input_ids"][:1].tolist() == [70 + step]
        assert buffers["positions"][:1].tolist() == [5 + step]
        assert buffers["seq_lens"][:1].tolist() == [6 + step]
        assert buffers["slot_mapping"][:1].tolist() == [BLOCK_SIZE + 1 + step]  # block 1
    for step in (0, 3):
        message = (
            f"step {step} of a run of 1 sequences: prepare() staged slots for 2 later steps; "
            "pass num_steps to it"
        )
        with pytest.raises(ValueError) as error:
            buffers.advance_decode(torch.tensor([0]), step)
        assert str(error.value) == message


@pytest.mark.usefixtures("copy_gap")
def test_reset_staged_makes_the_next_steps_write_every_field_in_full():
    """After ``reset_staged`` each staging buffer's next step is written as into a fresh buffer,
    even laid out like its last step: here both staging buffers hold junk in every field first
    (what an in-place update would leave standing, block-table rows past their ids included)."""
    buffers = make_buffers()
    scheduled, shape = mixed_step()
    for _ in range(2):
        assert_step_matches(buffers, scheduled, shape)
    for views in buffers._staging_views:
        for view in views.values():
            view[...] = 77
    buffers.reset_staged()
    for _ in range(2):
        assert_step_matches(buffers, scheduled, shape)


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
    buffers = make_buffers()
    for _ in range(2):  # both staging buffers hold the base step
        assert_step_matches(buffers, scheduled, shape)
    assert_step_matches(buffers, *LAYOUT_CHANGES[change](scheduled, shape))


@pytest.mark.parametrize("rows", [{"r0": 0, "r10": 1}, {"r0": 1, "r10": 0}])
@pytest.mark.usefixtures("copy_gap")
def test_placeholder_rows_unlike_the_buffers_last_step_are_staged_again(rows):
    """Two decodes with their tokens on the device, laid out like the buffer's last step but for
    the rows of the sampled ids they take (swapped, or in order after swapped): each still gets
    its own id."""
    scheduled = [decode(0, on_device=True), decode(10, on_device=True)]
    shape = StepShape(2, 2, 2, 2, 1)
    buffers = make_buffers()
    other = {"r0": rows["r10"], "r10": rows["r0"]}
    for _ in range(2):
        assert_step_matches(buffers, scheduled, shape, other)
    assert_step_matches(buffers, scheduled, shape, rows)


def test_a_fresh_buffer_has_nothing_to_sample_fill_in_or_advance():
    """Before any ``prepare``: no rows to sample, no tokens to fill in from the device, and no
    later step staged (``advance_decode`` refuses step 1)."""
    buffers = make_buffers(max_num_steps=4)
    assert buffers.logits_indices().tolist() == [] and buffers.num_logits == 0
    assert buffers.num_placeholders == 0
    with pytest.raises(ValueError, match="prepare\\(\\) staged slots for 0 later steps"):
        buffers.advance_decode(torch.tensor([7]), 1)


@pytest.mark.usefixtures("copy_gap")
def test_a_two_step_run_stages_the_second_steps_slots():
    """``num_steps=2``: one later step staged, its slots through the next block for r0 (position
    4) and the same block for r10 (position 6); a third step is refused."""
    buffers = make_buffers(max_num_steps=2)
    scheduled = [scheduled_request(3, 1, 3, 1, 0), scheduled_request(5, 1, 5, 1, 10)]
    scheduled[0].request.block_ids = [0, 1]  # position 4 reserved ahead
    buffers.prepare(scheduled, StepShape(2, 2, 2, 2, 1), BLOCK_SIZE, num_steps=2)
    buffers.advance_decode(torch.tensor([71, 81]), 1)
    assert buffers["slot_mapping"][:2].tolist() == [1 * BLOCK_SIZE + 0, 11 * BLOCK_SIZE + 2]
    assert buffers["positions"][:2].tolist() == [4, 6]
    with pytest.raises(ValueError, match="staged slots for 1 later steps"):
        buffers.advance_decode(torch.tensor([72, 82]), 2)


def test_a_dummy_step_after_real_steps_on_both_staging_buffers_reads_no_real_block():
    """Real steps leave block ids in every row of both staging buffers; the dummy steps that
    follow on each read only zero block tables, no real step's values."""
    buffers = make_buffers()
    scheduled, shape = mixed_step()
    for _ in range(2):
        assert_step_matches(buffers, scheduled, shape)
    for _ in range(2):
        metadata = buffers.prepare_dummy(StepShape(4, 4, 4, 4, 1), uniform_decode=True)
        assert metadata.block_tables.tolist() == [[0] * MAX_BLOCKS_PER_SEQ] * 4
        assert metadata.seq_lens.tolist() == [1] * 4 and metadata.state_indices.tolist() == [0] * 4
