"""``InputBuffers``: the runner's persistent input tensors, allocated once at their maximum size.

Every field a step's forward reads (input ids, positions, slots, block tables, sequence lengths,
...) lives at a fixed offset of one packed device buffer, with two pinned host staging buffers of
the same layout. The host fills a staging buffer with numpy (``worker/step_inputs.py`` does, one
step at a time) and the step's used rows go to the device in as few copies as the layout allows,
usually one. Every tensor handed out is a prefix view of a fixed field, so a captured graph reads
the next step from the addresses it was captured with.

The two staging buffers are used in turn, so a step is prepared while the previous step's copy
may still be queued; before a buffer is refilled, the copy that last read it is waited for (an
event; in practice long done).

This module owns the memory, its layout, the copies and the views; what a step writes into it is
``StepInputs``' (``worker/step_inputs.py``), and the on-device advance of a multi-step decode run
is ``worker/multi_step.py``'s.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import torch


@dataclasses.dataclass
class StepShape:
    """How one step is laid out in the buffers: real and padded sizes, the kernel's query bound."""

    num_tokens: int  # real tokens
    num_tokens_padded: int
    num_seqs: int  # real sequences
    num_seqs_padded: int
    max_query_len: int


# Used ranges of the staging buffer less than this many bytes apart go to the device as one copy:
# a separate copy costs several microseconds of host time, more than these bytes take over PCIe.
MAX_COPY_GAP_BYTES = 64 * 1024
FIELD_ALIGNMENT = 256  # bytes: each field starts where a fresh allocation would
MAX_CACHED_VIEWS = 1024  # per-shape prefix views kept before the cache starts over


@dataclasses.dataclass(frozen=True)
class Field:
    """One named tensor inside the packed buffers; its rows are counted per step."""

    name: str
    # What counts its rows: "tokens", "seqs", "seqs+1", "logits", "placeholders" or "step_slots".
    rows: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int  # bytes from the start of the packed buffers
    row_bytes: int


class StepViews(NamedTuple):
    """Prefix views of the device fields for one padded (num_seqs, num_tokens)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor
    state_indices: torch.Tensor
    has_initial_state: torch.Tensor


class InputBuffers:
    """Device buffers plus pinned host mirrors, packed; the copies between them and the views.

    All fields live in one packed device buffer, each at a fixed offset, with a pinned host
    staging buffer of the same layout. The step's used rows reach the device in as few copies as
    the layout allows (usually one; see ``MAX_COPY_GAP_BYTES``) instead of one copy per field.
    The layout puts the fields that grow with the batch's sequences first and the block tables,
    the largest, last, so the used ranges sit close together.
    """

    def __init__(
        self,
        max_num_tokens: int,
        max_num_seqs: int,
        max_blocks_per_seq: int,
        device: torch.device,
        pin_memory: bool,
        create_event: Callable[[], Any] = lambda: None,
        max_num_steps: int = 1,
        max_num_logits: int | None = None,
    ) -> None:
        self.max_num_tokens, self.max_num_seqs = max_num_tokens, max_num_seqs
        self.max_blocks_per_seq = max_blocks_per_seq
        self.device = device
        # Rows sampled per step: one per sequence, or 1 + k per speculative decode.
        max_num_logits = max_num_logits or max_num_seqs
        self.fields = _layout(
            max_num_tokens, max_num_seqs, max_blocks_per_seq, max_num_steps, max_num_logits
        )
        num_bytes = self.fields[-1].offset + self.fields[-1].row_bytes * self.fields[-1].shape[0]
        self.packed_device = torch.zeros(num_bytes, dtype=torch.uint8, device=device)
        self.device_buffers = {f.name: _field_view(self.packed_device, f) for f in self.fields}
        self.staging = [
            torch.zeros(num_bytes, dtype=torch.uint8, pin_memory=pin_memory) for _ in range(2)
        ]
        self.staging_views = [
            {f.name: _field_view(packed, f).numpy() for f in self.fields} for packed in self.staging
        ]
        # Device only, never staged: the ids each step of a decode run sampled, step-major,
        # written by the captured decode tails (``worker/decode_tail.py``).
        self.sampled_steps = torch.zeros(
            max_num_steps * max_num_seqs, dtype=torch.int64, device=device
        )
        self._copy_events = [create_event(), create_event()]  # None: copies are synchronous
        self.staging_index = 1
        self.packed_host = self.staging[0]
        self.host: dict[str, np.ndarray] = self.staging_views[0]
        self._views: dict[tuple[int, int], StepViews] = {}
        self._copy_plans: dict[tuple[int, ...], list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.device_buffers[name]

    def next_staging(self) -> int:
        """Switch to the other staging buffer once the copy that last read it has run; its
        index."""
        index = self.staging_index = 1 - self.staging_index
        event = self._copy_events[index]
        if event is not None:
            event.synchronize()  # an event never recorded returns at once
        self.packed_host, self.host = self.staging[index], self.staging_views[index]
        return index

    def copy_to_device(
        self,
        shape: StepShape,
        num_logits: int = 0,
        num_placeholders: int = 0,
        num_step_slots: int = 0,
    ) -> None:
        """Start copying the step's used rows of the current staging buffer to the device."""
        key = (
            self.staging_index,
            shape.num_tokens_padded,
            shape.num_seqs_padded,
            num_logits,
            num_placeholders,
            num_step_slots,
        )
        views = self._copy_plans.get(key)
        if views is None:  # (device, staging) byte views of ``copy_ranges``, made once
            if len(self._copy_plans) >= MAX_CACHED_VIEWS:
                self._copy_plans.clear()
            ranges = self.copy_ranges(shape, num_logits, num_placeholders, num_step_slots)
            views = self._copy_plans[key] = [
                (self.packed_device[start:end], self.packed_host[start:end])
                for start, end in ranges
            ]
        for device_bytes, host_bytes in views:
            device_bytes.copy_(host_bytes, non_blocking=True)
        event = self._copy_events[self.staging_index]
        if event is not None:
            event.record()

    def copy_ranges(
        self,
        shape: StepShape,
        num_logits: int = 0,
        num_placeholders: int = 0,
        num_step_slots: int = 0,
    ) -> list[tuple[int, int]]:
        """Byte ranges a step copies: each field's used rows, merged across gaps below the limit.

        The bytes in a merged gap are rows no view of this step reads, so copying them is
        harmless; they only cost transfer time, which the gap limit bounds.
        """
        counts = {
            "tokens": shape.num_tokens_padded,
            "seqs": shape.num_seqs_padded,
            "seqs+1": shape.num_seqs_padded + 1,
            "logits": num_logits,
            "placeholders": num_placeholders,
            "step_slots": num_step_slots,
        }
        ranges: list[tuple[int, int]] = []
        for field in self.fields:  # in offset order
            used = counts[field.rows] * field.row_bytes
            if used == 0:
                continue
            if ranges and field.offset - ranges[-1][1] < MAX_COPY_GAP_BYTES:
                ranges[-1] = (ranges[-1][0], field.offset + used)
            else:
                ranges.append((field.offset, field.offset + used))
        return ranges

    def step_views(self, shape: StepShape) -> StepViews:
        """The step's prefix views of the device fields, made once per padded shape."""
        key = (shape.num_seqs_padded, shape.num_tokens_padded)
        views = self._views.get(key)
        if views is None:
            if len(self._views) >= MAX_CACHED_VIEWS:
                self._views.clear()
            seqs, tokens = key
            views = self._views[key] = StepViews(
                input_ids=self["input_ids"][:tokens],
                positions=self["positions"][:tokens],
                query_start_loc=self["query_start_loc"][: seqs + 1],
                seq_lens=self["seq_lens"][:seqs],
                block_tables=self["block_tables"][:seqs],
                slot_mapping=self["slot_mapping"][:tokens],
                state_indices=self["state_indices"][:seqs],
                has_initial_state=self["has_initial_state"][:seqs],
            )
        return views


def _layout(
    max_num_tokens: int,
    max_num_seqs: int,
    max_blocks_per_seq: int,
    max_num_steps: int = 1,
    max_num_logits: int | None = None,
) -> list[Field]:
    """Fields in packed order: small per-sequence ones, per-token ones, block tables last."""
    num_step_slots = (max_num_steps - 1) * max_num_seqs  # 0 without multi-step decode
    specs = [  # name, rows, shape, dtype
        ("query_start_loc", "seqs+1", (max_num_seqs + 1,), torch.int32),
        ("seq_lens", "seqs", (max_num_seqs,), torch.int32),
        ("state_indices", "seqs", (max_num_seqs,), torch.int32),
        ("has_initial_state", "seqs", (max_num_seqs,), torch.bool),
        ("logits_indices", "logits", (max_num_logits or max_num_seqs,), torch.int64),
        ("placeholder_dst", "placeholders", (max_num_seqs,), torch.int64),
        ("placeholder_src", "placeholders", (max_num_seqs,), torch.int64),
        ("step_slots", "step_slots", (num_step_slots,), torch.int64),
        ("input_ids", "tokens", (max_num_tokens,), torch.int64),
        ("positions", "tokens", (max_num_tokens,), torch.int64),
        ("slot_mapping", "tokens", (max_num_tokens,), torch.int64),
        ("block_tables", "seqs", (max_num_seqs, max_blocks_per_seq), torch.int32),
    ]
    fields, offset = [], 0
    for name, rows, shape, dtype in specs:
        row_bytes = math.prod(shape[1:]) * dtype.itemsize
        fields.append(Field(name, rows, shape, dtype, offset, row_bytes))
        offset += -(-row_bytes * shape[0] // FIELD_ALIGNMENT) * FIELD_ALIGNMENT
    return fields


def _field_view(packed: torch.Tensor, field: Field) -> torch.Tensor:
    """``field`` as a typed tensor viewing its bytes of the packed uint8 buffer."""
    num_bytes = field.row_bytes * field.shape[0]
    return packed[field.offset : field.offset + num_bytes].view(field.dtype).view(field.shape)
