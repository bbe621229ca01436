"""Multi-step decode on the device: the later steps' slots staged, and ``advance_decode``.

Proves that each later step of a multi-step decode run, made on the device by ``advance_decode``
from the slots ``prepare`` staged, holds that step's values (inputs, positions, lengths and
slots, across a block boundary), padded rows inert; and that a step beyond those staged is
refused with the count of staged steps.
Run: pytest tests/worker/test_multi_step_advance.py
"""

from __future__ import annotations

import pytest
import torch

from pieceworks.worker.input_buffers import StepShape
from tests.worker.step_builders import (
    BLOCK_SIZE,
    make_inputs,
    scheduled_request,
)


@pytest.mark.usefixtures("copy_gap")
def test_advance_decode_gives_each_later_step_of_a_multi_step_run():
    """Three decodes padded to 4 sequences (a FULL decode layout), run 4 steps: after each
    ``advance_decode`` the device fields hold that step (the sampled ids as inputs, positions and
    lengths one further, slots through the blocks reserved ahead, one step crossing into a new
    block), and the padded row stays inert."""
    inputs = make_inputs(max_num_steps=4)
    scheduled = []
    for prompt_len, first_block in [(3, 0), (6, 4), (9, 8)]:
        item = scheduled_request(prompt_len, 1, prompt_len, 1, first_block)
        # Blocks for the 3 later steps, reserved ahead: positions up to prompt_len + 3 (r0 goes
        # from position 3 in its first block to 4-6 in its second).
        item.request.block_ids = list(range(first_block, first_block + 4))
        scheduled.append(item)
    shape = StepShape(3, 4, 3, 4, 1)
    inputs.prepare(scheduled, shape, num_steps=4)
    for step in range(1, 4):
        sampled = torch.tensor([70 + step, 80 + step, 90 + step])
        inputs.advance_decode(sampled, step)
        positions = [item.num_computed_tokens + step for item in scheduled]
        slots = [
            item.request.block_ids[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
            for item, p in zip(scheduled, positions)
        ]
        assert inputs.buffers["input_ids"][:4].tolist() == sampled.tolist() + [0]
        assert inputs.buffers["positions"][:4].tolist() == positions + [0]
        assert inputs.buffers["seq_lens"][:4].tolist() == [p + 1 for p in positions] + [0]
        assert inputs.buffers["slot_mapping"][:4].tolist() == slots + [-1]
    with pytest.raises(ValueError, match="step 4 of a run of 3 sequences: prepare\\(\\) staged"):
        inputs.advance_decode(sampled, 4)


@pytest.mark.usefixtures("copy_gap")
def test_advance_decode_of_one_sequence_and_the_steps_it_refuses():
    """One sequence run 3 steps: 2 later steps staged, each one position on; step 0 and step 3
    are refused with the count of staged steps (the message in full)."""
    inputs = make_inputs(max_num_steps=3)
    item = scheduled_request(5, 1, 5, 1, first_block=0)
    item.request.block_ids = [0, 1]  # positions 5, 6, 7: reserved ahead
    inputs.prepare([item], StepShape(1, 1, 1, 1, 1), num_steps=3)
    for step in (1, 2):
        inputs.advance_decode(torch.tensor([70 + step]), step)
        assert inputs.buffers["input_ids"][:1].tolist() == [70 + step]
        assert inputs.buffers["positions"][:1].tolist() == [5 + step]
        assert inputs.buffers["seq_lens"][:1].tolist() == [6 + step]
        assert inputs.buffers["slot_mapping"][:1].tolist() == [BLOCK_SIZE + 1 + step]  # block 1
    for step in (0, 3):
        message = (
            f"step {step} of a run of 1 sequences: prepare() staged slots for 2 later steps; "
            "pass num_steps to it"
        )
        with pytest.raises(ValueError) as error:
            inputs.advance_decode(torch.tensor([0]), step)
        assert str(error.value) == message


@pytest.mark.usefixtures("copy_gap")
def test_a_two_step_run_stages_the_second_steps_slots():
    """``num_steps=2``: one later step staged, its slots through the next block for r0 (position
    4) and the same block for r10 (position 6); a third step is refused."""
    inputs = make_inputs(max_num_steps=2)
    scheduled = [scheduled_request(3, 1, 3, 1, 0), scheduled_request(5, 1, 5, 1, 10)]
    scheduled[0].request.block_ids = [0, 1]  # position 4 reserved ahead
    inputs.prepare(scheduled, StepShape(2, 2, 2, 2, 1), num_steps=2)
    inputs.advance_decode(torch.tensor([71, 81]), 1)
    assert inputs.buffers["slot_mapping"][:2].tolist() == [1 * BLOCK_SIZE + 0, 11 * BLOCK_SIZE + 2]
    assert inputs.buffers["positions"][:2].tolist() == [4, 6]
    with pytest.raises(ValueError, match="staged slots for 1 later steps"):
        inputs.advance_decode(torch.tensor([72, 82]), 2)
