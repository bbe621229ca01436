"""``InputBuffers`` with packed fields: fixed addresses, few copies, two staging buffers in turn.

Proves that (1) every metadata tensor and model input of a padded shape has the same address on
every step of that shape (a captured graph reads them there); (2) a step's copies cover every used
byte of every field, one copy at the default sizes and more only across gaps of at least
``MAX_COPY_GAP_BYTES``; (3) the two staging buffers alternate and a step waits only on the copy
two steps back.
Run: pytest tests/worker/test_input_buffers.py
"""

from __future__ import annotations

import pytest
import torch

from pieceworks.worker.input_buffers import MAX_COPY_GAP_BYTES, InputBuffers, StepShape
from pieceworks.worker.step_inputs import StepInputs
from tests.worker.step_builders import (
    BLOCK_SIZE,
    MAX_BLOCKS_PER_SEQ,
    MAX_NUM_SEQS,
    MAX_NUM_TOKENS,
    assert_step_matches,
    make_inputs,
    mixed_step,
    scheduled_request,
)


def test_addresses_fixed_across_steps_of_one_padded_shape():
    inputs = make_inputs()
    shape = StepShape(3, 4, 3, 4, 1)

    def addresses(first_block: int) -> list[int]:
        scheduled = [scheduled_request(4, 2, 5, 1, first_block + 10 * i) for i in range(3)]
        metadata = inputs.prepare(scheduled, shape)
        tensors = [
            *inputs.model_inputs(shape),
            metadata.query_start_loc,
            metadata.seq_lens,
            metadata.block_tables,
            metadata.slot_mapping,
            metadata.state_indices,
            metadata.has_initial_state,
            inputs.logits_indices(),
        ]
        return [tensor.data_ptr() for tensor in tensors]

    first = addresses(0)
    inputs.prepare_dummy(StepShape(9, 16, 5, 8, 2))  # another shape in between
    assert addresses(40) == first
    # Each is the start of its field: a prefix view, as a graph of any size expects.
    names = ["input_ids", "positions", "query_start_loc", "seq_lens", "block_tables",
             "slot_mapping", "state_indices", "has_initial_state", "logits_indices"]  # fmt: skip
    assert first == [inputs.buffers[name].data_ptr() for name in names]
    # The views themselves are made once per padded shape: a step builds no tensors for them.
    assert inputs.metadata(shape, 0).seq_lens is inputs.metadata(shape, 0).seq_lens


@pytest.mark.parametrize("max_num_tokens", [64, 2048, 16384])
@pytest.mark.parametrize("num_seqs,num_tokens", [(1, 1), (4, 4), (8, 64), (2, 40)])
def test_copies_cover_every_used_byte(max_num_tokens, num_seqs, num_tokens):
    buffers = make_inputs(max_num_tokens, max_num_steps=4).buffers
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

    inputs = StepInputs(
        InputBuffers(
            MAX_NUM_TOKENS,
            MAX_NUM_SEQS,
            MAX_BLOCKS_PER_SEQ,
            torch.device("cpu"),
            False,
            create_event,
        ),
        BLOCK_SIZE,
    )
    staging = []
    for step in range(4):
        if step % 2:
            inputs.prepare_dummy(StepShape(2, 2, 2, 2, 1))
        else:
            assert_step_matches(inputs, *mixed_step())
        staging.append(inputs.buffers.packed_host.data_ptr())
    # Steps 0 and 1 find fresh buffers; steps 2 and 3 wait on the copies of steps 0 and 1.
    assert log == [(0, False), (1, False), (0, True), (1, True)]
    assert staging[0] == staging[2] != staging[1] == staging[3]
