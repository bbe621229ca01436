"""Builders shared by the step-input tests: a ``StepInputs`` over CPU buffers, scheduled
requests with distinct ids and blocks, and the reference every field of a step is checked against.

The "device" is the CPU here: device and staging buffers are still separate tensors, so a field
the copies missed would read stale values.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from pieceworks.scheduler.output import ScheduledRequest
from pieceworks.scheduler.request import Request
from pieceworks.worker.input_buffers import InputBuffers, StepShape
from pieceworks.worker.step_inputs import StepInputs

BLOCK_SIZE = 4
MAX_NUM_TOKENS, MAX_NUM_SEQS, MAX_BLOCKS_PER_SEQ = 64, 8, 16


def make_inputs(max_num_tokens: int = MAX_NUM_TOKENS, max_num_steps: int = 1) -> StepInputs:
    buffers = InputBuffers(
        max_num_tokens,
        MAX_NUM_SEQS,
        MAX_BLOCKS_PER_SEQ,
        torch.device("cpu"),
        pin_memory=False,
        max_num_steps=max_num_steps,
    )
    return StepInputs(buffers, BLOCK_SIZE)


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
    inputs: StepInputs, scheduled, shape: StepShape, sampled_rows: dict[str, int] | None = None
) -> None:
    """``prepare`` the step and compare every field the forward reads with ``reference_step``;
    ``sampled_rows``: the decodes whose token is on the device, and their rows in the previous
    step's sampled ids (here 900, 901, ...), filled in by ``fill_placeholders``."""
    sampled = torch.arange(900, 900 + MAX_NUM_SEQS)
    metadata = inputs.prepare(scheduled, shape, sampled_rows, sampled=sampled)
    input_ids, positions = inputs.model_inputs(shape)
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
        "logits_indices": inputs.logits_indices(),
    }
    assert inputs.num_logits == num_logits
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
