"""``StepInputs``: fills the persistent ``InputBuffers`` for one step and hands out its inputs.

Each step is built on the host with numpy (vectorised over tokens; loops only over requests) in a
staging buffer, copied into the prefix of each device field, and read by the forward through the
step's metadata and model inputs (prefix views, the same addresses every step of a padded shape).
Padded rows are inert: padded tokens have slot -1 (the KV store skips them) and padded sequences
have query length 0, context length 0 and the null state slot 0.

A decode token that is still on the device (async scheduling) is not staged: ``prepare`` lists
where it goes and which row of the previous step's sampled ids holds it (``placeholder_dst`` /
``placeholder_src``), copied with the rest, and then copies it on the device
(``fill_placeholders``).

A staging buffer is updated, not rebuilt: the scheduled requests' values are gathered in one pass
over them (``StepColumns``, ``worker/step_columns.py``), a block-table row is written only where its
request's block ids changed, and when a step has the same layout as the one the buffer last held
(the same requests with the same query lengths, state slots and placeholder rows: a steady decode
batch) the fields that follow from the layout alone (query start locations, state indices, logits
rows, placeholder rows, padding) are left as they are; only lengths, positions and slots are
written.

For a multi-step decode output (``num_steps`` > 1) ``prepare`` also stages the later steps'
slots, and ``advance_decode`` moves the device buffers on by one step (``worker/multi_step.py``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from pieceworks.models.attention.metadata import AttentionMetadata
from pieceworks.scheduler.output import ScheduledRequest
from pieceworks.worker import multi_step
from pieceworks.worker.input_buffers import InputBuffers, StepShape
from pieceworks.worker.step_columns import StepColumns

_EMPTY_ROW: tuple[list[int] | None, int] = (None, 0)


class StepInputs:
    """Lays a step's scheduled requests into ``buffers``; its metadata, model inputs and rows to
    sample. Remembers, per staging buffer, what it last wrote there, to write only what changed."""

    def __init__(self, buffers: InputBuffers, block_size: int) -> None:
        self.buffers = buffers
        self.block_size = block_size
        self.num_placeholders = 0
        self.num_step_slots = 0  # staged slots of a multi-step output's later steps
        self.num_logits = 0  # rows of the step's hidden states that are sampled
        self._logits_rows_lead = False  # they are rows 0 .. num_logits - 1
        # Per staging buffer: the layout of the step it last held (None: unknown, a dummy step)
        # and whether that step's sampled rows lead the hidden states.
        self._layouts: list[tuple | None] = [None, None]
        self._logits_lead = [False, False]
        # (first dst, first src) when the placeholder rows are two runs of consecutive rows.
        self._placeholder_runs: list[tuple[int, int] | None] = [None, None]
        # Per staging buffer and block-table row: (the block-id list written, ids written).
        self._table_rows: list[list[tuple[list[int] | None, int]]] = [
            [_EMPTY_ROW] * buffers.max_num_seqs for _ in range(2)
        ]

    def prepare(
        self,
        scheduled: Sequence[ScheduledRequest],
        shape: StepShape,
        sampled_rows: Mapping[str, int] | None = None,
        num_steps: int = 1,
        sampled: torch.Tensor | None = None,
    ) -> AttentionMetadata:
        """Lay out the scheduled requests, pad, copy to the device, fill the tokens still on the
        device; return the step's metadata.

        ``sampled`` holds the previous step's sampled ids (device) and ``sampled_rows`` maps a
        request id to its row there; both are needed for every request whose token is still on
        the device (async scheduling). ``num_steps`` > 1 (a uniform decode run that many times)
        also stages the later steps' slots for ``advance_decode``.
        """
        buffers = self.buffers
        index = buffers.next_staging()
        columns = StepColumns.gather(scheduled, sampled_rows or {})
        layout = columns.layout(shape)
        # The same layout as this staging buffer's last step (a steady decode batch): the fields
        # that follow from the layout alone already hold the right values.
        same_layout = layout == self._layouts[index]
        self._layouts[index] = layout
        query_lens = np.array(columns.query_lens, dtype=np.int64)
        computed = np.array(columns.computed, dtype=np.int64)
        self._fill_sequences(scheduled, columns, query_lens, computed, shape, same_layout)
        self._fill_tokens(columns, query_lens, computed, shape, same_layout)
        self.num_step_slots = multi_step.stage_step_slots(
            buffers, computed, shape.num_seqs, self.block_size, num_steps
        )
        if not same_layout:
            self._fill_logits_indices(columns.producing_rows, columns.logits_counts, shape.num_seqs)
        self.num_logits = sum(columns.logits_counts)
        self._logits_rows_lead = self._logits_lead[index]
        buffers.copy_to_device(shape, self.num_logits, self.num_placeholders, self.num_step_slots)
        if self.num_placeholders:  # decode tokens still on the device
            assert sampled is not None
            self.fill_placeholders(sampled)
        return self.metadata(shape, columns.num_decodes)

    def reset_staged(self) -> None:
        """Forget what the staging buffers hold, as if freshly allocated: the next ``prepare`` of
        each writes every field in full (the reference that tests compare the incremental
        updates against)."""
        self._layouts = [None, None]
        self._placeholder_runs = [None, None]
        self._table_rows = [[_EMPTY_ROW] * self.buffers.max_num_seqs for _ in range(2)]
        for views in self.buffers.staging_views:
            views["block_tables"][:] = 0

    def _fill_sequences(
        self,
        scheduled: Sequence[ScheduledRequest],
        columns: StepColumns,
        query_lens: np.ndarray,
        computed: np.ndarray,
        shape: StepShape,
        same_layout: bool,
    ) -> None:
        host, num_seqs, padded = self.buffers.host, shape.num_seqs, shape.num_seqs_padded
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
        table = self.buffers.host["block_tables"]
        rows = self._table_rows[self.buffers.staging_index]
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
        table = self.buffers.host["block_tables"]
        rows = self._table_rows[self.buffers.staging_index]
        for row in range(start, end):
            if rows[row][1]:
                table[row, : rows[row][1]] = 0
            rows[row] = _EMPTY_ROW

    def _fill_tokens(
        self,
        columns: StepColumns,
        query_lens: np.ndarray,
        computed: np.ndarray,
        shape: StepShape,
        same_layout: bool,
    ) -> None:
        host, num_tokens, padded = self.buffers.host, shape.num_tokens, shape.num_tokens_padded
        block_size = self.block_size
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
            self._placeholder_runs[self.buffers.staging_index] = _runs(
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

    def _fill_logits_indices(
        self, producing_rows: list[int], counts: list[int], num_seqs: int
    ) -> None:
        """The last token row of each request that samples a token; for a speculative decode,
        its last ``counts[i]`` rows (its own token's and its proposals')."""
        host = self.buffers.host
        ends = host["query_start_loc"][1 : num_seqs + 1][producing_rows].astype(np.int64)
        num_logits = sum(counts)
        if num_logits == len(producing_rows):
            indices = ends - 1
        else:
            counts_array = np.asarray(counts, dtype=np.int64)
            first_index = np.repeat(np.cumsum(counts_array) - counts_array, counts_array)
            indices = np.repeat(ends - counts_array, counts_array) + (
                np.arange(num_logits) - first_index
            )
        host["logits_indices"][:num_logits] = indices
        self._logits_lead[self.buffers.staging_index] = _is_range(indices, start=0)

    def fill_placeholders(self, sampled: torch.Tensor) -> None:
        """Write the previous step's sampled ids (device, ``sampled``) into the input ids of the
        decodes whose token the host has not seen: one slice copy when both sides are runs of
        consecutive rows (a steady decode batch), else an indexed copy."""
        buffers, count = self.buffers, self.num_placeholders
        runs = self._placeholder_runs[buffers.staging_index]
        if count and runs is not None:
            first_dst, first_src = runs
            rows = buffers["input_ids"][first_dst : first_dst + count]
            rows.copy_(sampled[first_src : first_src + count])
            return
        dst, src = buffers["placeholder_dst"][:count], buffers["placeholder_src"][:count]
        buffers["input_ids"].index_copy_(0, dst, sampled.index_select(0, src))

    def advance_decode(self, sampled: torch.Tensor, step: int) -> None:
        """Make step ``step`` (>= 1) of the multi-step decode output this step prepared, on the
        device, from the previous step's sampled ids ``sampled`` (S,) (``worker/multi_step.py``)."""
        multi_step.advance_decode(self.buffers, sampled, step, self.num_step_slots)

    def prepare_dummy(self, shape: StepShape, uniform_decode: bool = False) -> AttentionMetadata:
        """``num_seqs`` fresh sequences sharing the tokens, writing nothing to the caches.

        ``uniform_decode`` (one token per sequence) marks every sequence a decode, so a captured
        decode graph records the Mamba decode kernels; like every dummy run they read and write
        only the null state slot 0.
        """
        self._layouts[self.buffers.next_staging()] = None
        self.num_placeholders = self.num_logits = self.num_step_slots = 0
        host, num_seqs, padded_seqs = self.buffers.host, shape.num_seqs, shape.num_seqs_padded
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
        self.buffers.copy_to_device(shape)
        return self.metadata(shape, num_decodes=padded_seqs if uniform_decode else 0)

    def metadata(self, shape: StepShape, num_decodes: int) -> AttentionMetadata:
        """The attention metadata of a step of ``shape``: prefix views of the device fields."""
        views = self.buffers.step_views(shape)
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
        views = self.buffers.step_views(shape)
        return views.input_ids, views.positions

    def logits_indices(self) -> torch.Tensor:
        """(num_logits,) int64 on the device: the rows of the hidden states to sample from."""
        return self.buffers.device_buffers["logits_indices"][: self.num_logits]

    def logits_rows(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The rows of ``hidden_states`` to sample from, ``(num_logits, hidden)``: a view when they
        are its first rows (a step of decodes only), else a gather by ``logits_indices``."""
        if self._logits_rows_lead:
            return hidden_states[: self.num_logits]
        return hidden_states[self.logits_indices()]


def _runs(dst: list[int], src: list[int]) -> tuple[int, int] | None:
    """``(dst[0], src[0])`` when both lists are runs of consecutive rows, else None."""
    if dst and _is_range(dst, dst[0]) and _is_range(src, src[0]):
        return dst[0], src[0]
    return None


def _is_range(values: np.ndarray | list[int], start: int) -> bool:
    """Whether ``values`` are ``start, start + 1, ...`` (consecutive rows)."""
    return bool(np.array_equal(values, np.arange(start, start + len(values))))
