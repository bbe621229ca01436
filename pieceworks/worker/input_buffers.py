"""``InputBuffers``: the runner's persistent input tensors, allocated once at their maximum size.

Each step is built on the host with numpy (vectorised over tokens; loops only over requests) in a
pinned staging buffer and copied into the prefix of each device field (all fields share one packed
buffer, so that is usually one copy per step); every captured graph reads the new step from the
addresses it was captured with. Padded rows are inert: padded tokens have slot -1 (the KV store
skips them) and padded sequences have query length 0, context length 0 and the null state slot 0.

There are two staging buffers, used in turn, so a step is prepared while the previous step's copy
may still be queued; before a buffer is refilled, the copy that last read it is waited for (an
event; in practice long done). A decode token that is still on the device (async scheduling) is
not staged: ``prepare`` lists where it goes and which row of the previous step's sampled ids holds
it (``placeholder_dst`` / ``placeholder_src``), and the runner copies it on the device.

A staging buffer is updated, not rebuilt: the scheduled requests' values are gathered in one pass
over them (``_StepColumns``), a block-table row is written only where its request's block ids
changed, and when a step has the same layout as the one the buffer last held (the same requests
with the same query lengths, state slots and placeholder rows: a steady decode batch) the fields
that follow from the layout alone (query start locations, state indices, logits rows, placeholder
rows, padding) are left as they are; only lengths, positions and slots are written.

For a multi-step decode output (``num_steps`` > 1) ``prepare`` also stages the slot of every
later step (``step_slots``: step 1's for every sequence, then step 2's, ...; their blocks are
reserved ahead), copied with the rest, so ``advance_decode`` moves a step on with four small
device ops and no block-table lookup.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from pieceworks.models.attention.metadata import AttentionMetadata
from pieceworks.scheduler.output import PLACEHOLDER_TOKEN_ID, ScheduledRequest


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
class _Field:
    """One named tensor inside the packed buffers; its rows are counted per step."""

    name: str
    # What counts its rows: "tokens", "seqs", "seqs+1", "logits", "placeholders" or "step_slots".
    rows: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int  # bytes from the start of the packed buffers
    row_bytes: int


class InputBuffers:
    """Device buffers plus pinned host mirrors; ``prepare`` fills both for a step.

    All fields live in one packed device buffer, each at a fixed offset, with a pinned host
    staging buffer of the same layout. The host fills the staging buffer with numpy; the step's
    used rows then reach the device in as few copies as the layout allows (usually one; see
    ``MAX_COPY_GAP_BYTES``) instead of one copy per field. The layout puts the fields that grow
    with the batch's sequences first and the block tables, the largest, last, so the used ranges
    sit close together. Every tensor handed out is a prefix view of a fixed field, so a captured
    graph reads the next step from the addresses it was captured with.
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
    ) -> None:
        self.max_num_tokens, self.max_num_seqs = max_num_tokens, max_num_seqs
        self.max_blocks_per_seq = max_blocks_per_seq
        self.device = device
        self.fields = _layout(max_num_tokens, max_num_seqs, max_blocks_per_seq, max_num_steps)
        num_bytes = self.fields[-1].offset + self.fields[-1].row_bytes * self.fields[-1].shape[0]
        self.packed_device = torch.zeros(num_bytes, dtype=torch.uint8, device=device)
        self.device_buffers = {f.name: _field_view(self.packed_device, f) for f in self.fields}
        self._staging = [
            torch.zeros(num_bytes, dtype=torch.uint8, pin_memory=pin_memory) for _ in range(2)
        ]
        self._staging_views = [
            {f.name: _field_view(packed, f).numpy() for f in self.fields}
            for packed in self._staging
        ]
        # Device only, never staged: the ids each step of a decode run sampled, step-major,
        # written by the captured decode tails (``worker/decode_tail.py``).
        self.sampled_steps = torch.zeros(
            max_num_steps * max_num_seqs, dtype=torch.int64, device=device
        )
        self._copy_events = [create_event(), create_event()]  # None: copies are synchronous
        self._staging_index = 1
        self.packed_host = self._staging[0]
        self.host = self._staging_views[0]
        self.num_placeholders = 0
        self.num_step_slots = 0  # staged slots of a multi-step output's later steps
        self.num_logits = 0  # rows of the step's hidden states that are sampled
        self._logits_rows_lead = False  # they are rows 0 .. num_logits - 1
        self._views: dict[tuple[int, int], _StepViews] = {}
        self._copy_plans: dict[tuple[int, ...], list[tuple[torch.Tensor, torch.Tensor]]] = {}
        # Per staging buffer: the layout of the step it last held (None: unknown, a dummy step)
        # and whether that step's sampled rows lead the hidden states.
        self._layouts: list[tuple | None] = [None, None]
        self._logits_lead = [False, False]
        # (first dst, first src) when the placeholder rows are two runs of consecutive rows.
        self._placeholder_runs: list[tuple[int, int] | None] = [None, None]
        # Per staging buffer and block-table row: (the block-id list written, ids written).
        self._table_rows: list[list[tuple[list[int] | None, int]]] = [
            [_EMPTY_ROW] * max_num_seqs for _ in range(2)
        ]

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.device_buffers[name]

    def prepare(
        self,
        scheduled: Sequence[ScheduledRequest],
        shape: StepShape,
        block_size: int,
        sampled_rows: Mapping[str, int] | None = None,
        num_steps: int = 1,
    ) -> AttentionMetadata:
        """Lay out the scheduled requests, pad, copy to the device; return the step's metadata.

        ``sampled_rows`` maps a request id to its row in the previous step's sampled ids; it is
        needed for every request whose token is still on the device (async scheduling).
        ``num_steps`` > 1 (a uniform decode run that many times) also stages the later steps'
        slots for ``advance_decode``.
        """
        self._next_staging()
        columns = _StepColumns.gather(scheduled, sampled_rows or {})
        layout = columns.layout(shape)
        # The same layout as this staging buffer's last step (a steady decode batch): the fields
        # that follow from the layout alone already hold the right values.
        same_layout = layout == self._layouts[self._staging_index]
        self._layouts[self._staging_index] = layout
        query_lens = np.array(columns.query_lens, dtype=np.int64)
        computed = np.array(columns.computed, dtype=np.int64)
        self._fill_sequences(scheduled, columns, query_lens, computed, shape, same_layout)
        self._fill_tokens(columns, query_lens, computed, shape, block_size, same_layout)
        self._fill_step_slots(computed, shape.num_seqs, block_size, num_steps)
        if not same_layout:
            self._fill_logits_indices(columns.producing_rows, shape.num_seqs)
        self.num_logits = len(columns.producing_rows)
        self._logits_rows_lead = self._logits_lead[self._staging_index]
        self._copy_to_device(shape, self.num_logits)
        return self.metadata(shape, columns.num_decodes)

    def reset_staged(self) -> None:
        """Forget what the staging buffers hold, as if freshly allocated: the next ``prepare`` of
        each writes every field in full (the reference that tests compare the incremental
        updates against)."""
        self._layouts = [None, None]
        self._placeholder_runs = [None, None]
        self._table_rows = [[_EMPTY_ROW] * self.max_num_seqs for _ in range(2)]
        for views in self._staging_views:
            views["block_tables"][:] = 0

    def _fill_sequences(
        self,
        scheduled: Sequence[ScheduledRequest],
        columns: _StepColumns,
        query_lens: np.ndarray,
        computed: np.ndarray,
        shape: StepShape,
        same_layout: bool,
    ) -> None:
        host, num_seqs, padded = self.host, shape.num_seqs, shape.num_seqs_padded
        host["seq_lens"][:num_seqs] = computed + query_lens
        host["has_initial_state"][:num_seqs] = computed > 0
        self._fill_block_tables(scheduled, padded, same_layout)
        if same_layout:
            return
        host["query_start_loc"][0] = 0
        np.cumsum(query_lens, out=host["query_start_loc"][1 : num_seqs + 1])
        host["query_start_loc"][num_seqs + 1 : padded + 1] = shape.num_tokens  # length 0
        host["seq_lens"][num_seqs:padded] = 0
        host["state_indices"][:num_seqs] = columns.state_slots
        host["state_indices"][num_seqs:padded] = 0  # the null slot, never read back
        host["has_initial_state"][num_seqs:padded] = False

    def _fill_block_tables(
        self, scheduled: Sequence[ScheduledRequest], num_padded: int, same_layout: bool
    ) -> None:
        """Each row's block ids, written only where they changed since this staging buffer last
        held the step; padded rows are zero.

        A row remembers the block-id list it was written from and how many ids it holds (the
        rest of the row is zero). ``BlockManager`` only ever appends to a request's list (freeing
        replaces it with a new one), so while a request stays in its row, only the ids appended
        since are written: a decode step usually writes none.
        """
        table, rows = self.host["block_tables"], self._table_rows[self._staging_index]
        for row, item in enumerate(scheduled):
            block_ids = item.request.block_ids
            held, num_written = rows[row]
            num_blocks = len(block_ids)
            if held is block_ids and num_written <= num_blocks:
                if num_written < num_blocks:
                    table[row, num_written:num_blocks] = block_ids[num_written:]
            else:
                table[row, :num_blocks] = block_ids
                if num_written > num_blocks:
                    table[row, num_blocks:num_written] = 0
            rows[row] = (block_ids, num_blocks)
        if not same_layout:  # else the padded rows are zero since this buffer's last step
            self._zero_table_rows(len(scheduled), num_padded)

    def _zero_table_rows(self, start: int, end: int) -> None:
        """Zero block-table rows [start, end) of the current staging buffer."""
        table, rows = self.host["block_tables"], self._table_rows[self._staging_index]
        for row in range(start, end):
            if rows[row][1]:
                table[row, : rows[row][1]] = 0
            rows[row] = _EMPTY_ROW

    def _fill_tokens(
        self,
        columns: _StepColumns,
        query_lens: np.ndarray,
        computed: np.ndarray,
        shape: StepShape,
        block_size: int,
        same_layout: bool,
    ) -> None:
        host, num_tokens, padded = self.host, shape.num_tokens, shape.num_tokens_padded
        num_placeholders = self.num_placeholders = len(columns.placeholder_dst)
        # Every token still on the device, in the layout staged last time: the staged ids are
        # overwritten on the device anyway, and the placeholder rows are staged already.
        if not (same_layout and num_placeholders == num_tokens):
            host["input_ids"][:num_tokens] = columns.token_ids
            if num_placeholders:
                dst = host["placeholder_dst"][:num_placeholders]
                dst[:] = columns.placeholder_dst
                host["placeholder_src"][:num_placeholders] = columns.placeholder_src
                host["input_ids"][dst] = 0  # overwritten on the device
            self._placeholder_runs[self._staging_index] = _runs(
                columns.placeholder_dst, columns.placeholder_src
            )
        if num_tokens == shape.num_seqs:  # one token per sequence: a decode step
            request_index, positions = np.arange(num_tokens), computed
        else:
            starts = host["query_start_loc"][: shape.num_seqs].astype(np.int64)
            request_index = np.repeat(np.arange(shape.num_seqs), query_lens)  # (T,)
            positions = np.arange(num_tokens) - starts[request_index] + computed[request_index]
        host["positions"][:num_tokens] = positions
        blocks = host["block_tables"][request_index, positions // block_size]
        host["slot_mapping"][:num_tokens] = (
            blocks.astype(np.int64) * block_size + positions % block_size
        )
        if same_layout:
            return
        host["input_ids"][num_tokens:padded] = 0
        host["positions"][num_tokens:padded] = 0
        host["slot_mapping"][num_tokens:padded] = -1  # padded tokens are never stored

    def _fill_step_slots(
        self, computed: np.ndarray, num_seqs: int, block_size: int, num_steps: int
    ) -> None:
        """The slots of steps 1 .. num_steps - 1 of a decode batch (position computed + step),
        step-major, (num_steps - 1) * num_seqs of them."""
        self.num_step_slots = (num_steps - 1) * num_seqs
        if num_steps == 1:
            return
        positions = computed + np.arange(1, num_steps)[:, None]  # (K - 1, S)
        blocks = self.host["block_tables"][np.arange(num_seqs), positions // block_size]
        slots = blocks.astype(np.int64) * block_size + positions % block_size
        self.host["step_slots"][: self.num_step_slots] = slots.ravel()

    def _fill_logits_indices(self, producing_rows: list[int], num_seqs: int) -> None:
        """The last token row of each request that samples a token."""
        ends = self.host["query_start_loc"][1 : num_seqs + 1]
        indices = ends[producing_rows] - 1
        self.host["logits_indices"][: len(producing_rows)] = indices
        self._logits_lead[self._staging_index] = _is_range(indices, start=0)

    def logits_indices(self) -> torch.Tensor:
        """(num_logits,) int64 on the device: the rows of the hidden states to sample from."""
        return self.device_buffers["logits_indices"][: self.num_logits]

    def logits_rows(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The rows of ``hidden_states`` to sample from, ``(num_logits, hidden)``: a view when they
        are its first rows (a step of decodes only), else a gather by ``logits_indices``."""
        if self._logits_rows_lead:
            return hidden_states[: self.num_logits]
        return hidden_states[self.logits_indices()]

    def fill_placeholders(self, sampled: torch.Tensor) -> None:
        """Write the previous step's sampled ids (device, ``sampled``) into the input ids of the
        decodes whose token the host has not seen: one slice copy when both sides are runs of
        consecutive rows (a steady decode batch), else an indexed copy."""
        count = self.num_placeholders
        runs = self._placeholder_runs[self._staging_index]
        if count and runs is not None:
            first_dst, first_src = runs
            rows = self["input_ids"][first_dst : first_dst + count]
            rows.copy_(sampled[first_src : first_src + count])
            return
        dst, src = self["placeholder_dst"][:count], self["placeholder_src"][:count]
        self["input_ids"].index_copy_(0, dst, sampled.index_select(0, src))

    def advance_decode(self, sampled: torch.Tensor, step: int) -> None:
        """Turn the device buffers of a multi-step decode output into its step ``step`` (>= 1),
        on the device: input ids become ``sampled`` (S,), the previous step's ids, positions and
        sequence lengths grow by one, and the slots are the ones ``prepare`` staged for that
        step. Padded rows stay inert; the staging buffers are untouched (the next ``prepare``
        writes every field it copies from them)."""
        num_seqs = sampled.shape[0]
        if not 1 <= step <= self.num_step_slots // max(num_seqs, 1):
            raise ValueError(
                f"step {step} of a run of {num_seqs} sequences: prepare() staged slots for "
                f"{self.num_step_slots // max(num_seqs, 1)} later steps; pass num_steps to it"
            )
        self.advance_rows(sampled, step)

    def advance_rows(self, sampled: torch.Tensor, step: int) -> None:
        """``advance_decode`` without its check against what ``prepare`` staged: the device ops
        alone, as a captured decode tail records them (its capture runs on a dummy step)."""
        num_seqs = sampled.shape[0]
        self["input_ids"][:num_seqs].copy_(sampled)
        self["positions"][:num_seqs].add_(1)
        self["seq_lens"][:num_seqs].add_(1)
        first = (step - 1) * num_seqs
        self["slot_mapping"][:num_seqs].copy_(self["step_slots"][first : first + num_seqs])

    def prepare_dummy(self, shape: StepShape, uniform_decode: bool = False) -> AttentionMetadata:
        """``num_seqs`` fresh sequences sharing the tokens, writing nothing to the caches.

        ``uniform_decode`` (one token per sequence) marks every sequence a decode, so a captured
        decode graph records the Mamba decode kernels; like every dummy run they read and write
        only the null state slot 0.
        """
        self._next_staging()
        self._layouts[self._staging_index] = None
        self.num_placeholders = self.num_logits = self.num_step_slots = 0
        host, num_seqs, padded_seqs = self.host, shape.num_seqs, shape.num_seqs_padded
        query_lens = np.full(num_seqs, shape.num_tokens // num_seqs, dtype=np.int64)
        query_lens[: shape.num_tokens % num_seqs] += 1  # spread the remainder: none too long
        host["query_start_loc"][0] = 0
        np.cumsum(query_lens, out=host["query_start_loc"][1 : num_seqs + 1])
        host["query_start_loc"][num_seqs + 1 : padded_seqs + 1] = shape.num_tokens
        host["seq_lens"][:num_seqs] = query_lens
        host["seq_lens"][num_seqs:padded_seqs] = 0
        self._zero_table_rows(0, padded_seqs)
        host["state_indices"][:padded_seqs] = 0  # dummy runs only touch the null state slot
        host["has_initial_state"][:padded_seqs] = False
        host["input_ids"][: shape.num_tokens_padded] = 0
        host["positions"][: shape.num_tokens_padded] = 0
        host["slot_mapping"][: shape.num_tokens_padded] = -1
        self._copy_to_device(shape)
        return self.metadata(shape, num_decodes=padded_seqs if uniform_decode else 0)

    def _next_staging(self) -> None:
        """Switch to the other staging buffer once the copy that last read it has run."""
        index = self._staging_index = 1 - self._staging_index
        event = self._copy_events[index]
        if event is not None:
            event.synchronize()  # an event never recorded returns at once
        self.packed_host, self.host = self._staging[index], self._staging_views[index]

    def _copy_to_device(self, shape: StepShape, num_logits: int = 0) -> None:
        for device_bytes, host_bytes in self._copy_views(shape, num_logits):
            device_bytes.copy_(host_bytes, non_blocking=True)
        event = self._copy_events[self._staging_index]
        if event is not None:
            event.record()

    def _copy_views(
        self, shape: StepShape, num_logits: int
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(device, staging) byte views of ``copy_ranges``, made once per step size and buffer."""
        key = (
            self._staging_index,
            shape.num_tokens_padded,
            shape.num_seqs_padded,
            num_logits,
            self.num_placeholders,
            self.num_step_slots,
        )
        views = self._copy_plans.get(key)
        if views is None:
            if len(self._copy_plans) >= MAX_CACHED_VIEWS:
                self._copy_plans.clear()
            ranges = self.copy_ranges(shape, num_logits, self.num_placeholders, self.num_step_slots)
            views = self._copy_plans[key] = [
                (self.packed_device[start:end], self.packed_host[start:end])
                for start, end in ranges
            ]
        return views

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

    def metadata(self, shape: StepShape, num_decodes: int) -> AttentionMetadata:
        views = self._step_views(shape)
        return AttentionMetadata(
            num_actual_tokens=shape.num_tokens,
            max_query_len=shape.max_query_len,
            query_start_loc=views.query_start_loc,
            seq_lens=views.seq_lens,
            block_tables=views.block_tables,
            slot_mapping=views.slot_mapping,
            state_indices=views.state_indices,
            has_initial_state=views.has_initial_state,
            num_decodes=num_decodes,
        )

    def model_inputs(self, shape: StepShape) -> tuple[torch.Tensor, torch.Tensor]:
        """``(input_ids, positions)`` of the step, each (num_tokens_padded,) on the device."""
        views = self._step_views(shape)
        return views.input_ids, views.positions

    def _step_views(self, shape: StepShape) -> _StepViews:
        """The step's prefix views of the device fields, made once per padded shape."""
        key = (shape.num_seqs_padded, shape.num_tokens_padded)
        views = self._views.get(key)
        if views is None:
            if len(self._views) >= MAX_CACHED_VIEWS:
                self._views.clear()
            seqs, tokens = key
            views = self._views[key] = _StepViews(
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


_EMPTY_ROW: tuple[list[int] | None, int] = (None, 0)


@dataclasses.dataclass
class _StepColumns:
    """The scheduled requests' per-step values as flat lists, gathered in one pass."""

    query_lens: list[int]
    computed: list[int]
    state_slots: list[int]
    token_ids: list[int]  # every scheduled token; a placeholder stays PLACEHOLDER_TOKEN_ID
    producing_rows: list[int]  # rows of the requests that sample a token
    placeholder_dst: list[int]  # token rows whose id is still on the device ...
    placeholder_src: list[int]  # ... and their rows in the previous step's sampled ids
    num_decodes: int

    @classmethod
    def gather(
        cls, scheduled: Sequence[ScheduledRequest], sampled_rows: Mapping[str, int]
    ) -> _StepColumns:
        # One comprehension per column: each runs as a tight loop, cheaper per request than
        # one loop appending to every column.
        token_ids = list(itertools.chain.from_iterable(s.new_token_ids for s in scheduled))
        pending = [s.request for s in scheduled if s.new_token_ids[-1] == PLACEHOLDER_TOKEN_ID]
        try:
            placeholder_src = [sampled_rows[request.request_id] for request in pending]
        except KeyError as error:
            raise RuntimeError(
                f"request {error.args[0]!r}: its last token is still on the device but the "
                "previous step did not sample it; this is a scheduler/runner bug"
            ) from None
        return cls(
            query_lens=[s.num_new_tokens for s in scheduled],
            computed=[s.num_computed_tokens for s in scheduled],
            state_slots=[s.request.state_slot or 0 for s in scheduled],
            token_ids=token_ids,
            producing_rows=[row for row, s in enumerate(scheduled) if s.produces_token],
            # Only a decode's one token can be pending, so these are its request's rows.
            placeholder_dst=[i for i, t in enumerate(token_ids) if t == PLACEHOLDER_TOKEN_ID],
            placeholder_src=placeholder_src,
            num_decodes=[s.is_decode for s in scheduled].count(True),
        )

    def layout(self, shape: StepShape) -> tuple:
        """What the layout-only fields follow from (positions and lengths are not in it)."""
        return (
            shape.num_tokens,
            shape.num_tokens_padded,
            shape.num_seqs_padded,
            self.query_lens,
            self.state_slots,
            self.producing_rows,
            self.placeholder_dst,
            self.placeholder_src,
        )


class _StepViews(NamedTuple):
    """Prefix views of the device fields for one padded (num_seqs, num_tokens)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor
    state_indices: torch.Tensor
    has_initial_state: torch.Tensor


def _layout(
    max_num_tokens: int, max_num_seqs: int, max_blocks_per_seq: int, max_num_steps: int = 1
) -> list[_Field]:
    """Fields in packed order: small per-sequence ones, per-token ones, block tables last."""
    num_step_slots = (max_num_steps - 1) * max_num_seqs  # 0 without multi-step decode
    specs = [  # name, rows, shape, dtype
        ("query_start_loc", "seqs+1", (max_num_seqs + 1,), torch.int32),
        ("seq_lens", "seqs", (max_num_seqs,), torch.int32),
        ("state_indices", "seqs", (max_num_seqs,), torch.int32),
        ("has_initial_state", "seqs", (max_num_seqs,), torch.bool),
        ("logits_indices", "logits", (max_num_seqs,), torch.int64),
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
        fields.append(_Field(name, rows, shape, dtype, offset, row_bytes))
        offset += -(-row_bytes * shape[0] // FIELD_ALIGNMENT) * FIELD_ALIGNMENT
    return fields


def _field_view(packed: torch.Tensor, field: _Field) -> torch.Tensor:
    """``field`` as a typed tensor viewing its bytes of the packed uint8 buffer."""
    num_bytes = field.row_bytes * field.shape[0]
    return packed[field.offset : field.offset + num_bytes].view(field.dtype).view(field.shape)


def _runs(dst: list[int], src: list[int]) -> tuple[int, int] | None:
    """``(dst[0], src[0])`` when both lists are runs of consecutive rows, else None."""
    if dst and _is_range(dst, dst[0]) and _is_range(src, src[0]):
        return dst[0], src[0]
    return None


def _is_range(values: np.ndarray | list[int], start: int) -> bool:
    """Whether ``values`` are ``start, start + 1, ...`` (consecutive rows)."""
    return bool(np.array_equal(values, np.arange(start, start + len(values))))
