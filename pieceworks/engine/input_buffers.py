"""``InputBuffers``: the runner's persistent input tensors, allocated once at their maximum size.

Each step is built on the host with numpy (vectorised over tokens; loops only over requests) and
copied into the prefix of each device buffer, so every captured graph reads the new step from the
addresses it was captured with. Padded rows are inert: padded tokens have slot -1 (the KV store
skips them) and padded sequences have query length 0, context length 0 and the null state slot 0.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import torch

from pieceworks.engine.scheduler import ScheduledRequest
from pieceworks.models.attention.metadata import AttentionMetadata


@dataclasses.dataclass
class StepShape:
    """How one step is laid out in the buffers: real and padded sizes, the kernel's query bound."""

    num_tokens: int  # real tokens
    num_tokens_padded: int
    num_seqs: int  # real sequences
    num_seqs_padded: int
    max_query_len: int


class InputBuffers:
    """Device buffers plus pinned host mirrors; ``prepare`` fills both for a step."""

    def __init__(
        self,
        max_num_tokens: int,
        max_num_seqs: int,
        max_blocks_per_seq: int,
        device: torch.device,
        pin_memory: bool,
    ) -> None:
        self.max_num_tokens, self.max_num_seqs = max_num_tokens, max_num_seqs
        self.max_blocks_per_seq = max_blocks_per_seq
        self.device = device
        specs = {  # name: (shape, dtype)
            "input_ids": ((max_num_tokens,), torch.int64),
            "positions": ((max_num_tokens,), torch.int64),
            "slot_mapping": ((max_num_tokens,), torch.int64),
            "query_start_loc": ((max_num_seqs + 1,), torch.int32),
            "seq_lens": ((max_num_seqs,), torch.int32),
            "block_tables": ((max_num_seqs, max_blocks_per_seq), torch.int32),
            "state_indices": ((max_num_seqs,), torch.int32),
            "has_initial_state": ((max_num_seqs,), torch.bool),
        }
        self.device_buffers = {
            name: torch.zeros(shape, dtype=dtype, device=device)
            for name, (shape, dtype) in specs.items()
        }
        self.host_buffers = {
            name: torch.zeros(shape, dtype=dtype, pin_memory=pin_memory)
            for name, (shape, dtype) in specs.items()
        }
        self.host = {name: tensor.numpy() for name, tensor in self.host_buffers.items()}

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.device_buffers[name]

    def prepare(
        self, scheduled: Sequence[ScheduledRequest], shape: StepShape, block_size: int
    ) -> AttentionMetadata:
        """Lay out the scheduled requests, pad, copy to the device; return the step's metadata."""
        query_lens = np.fromiter((s.num_new_tokens for s in scheduled), np.int64, len(scheduled))
        computed = np.fromiter((s.num_computed_tokens for s in scheduled), np.int64, len(scheduled))
        self._fill_sequences(scheduled, query_lens, computed, shape)
        self._fill_tokens(scheduled, query_lens, computed, shape, block_size)
        self._copy_to_device(shape)
        num_decodes = sum(1 for s in scheduled if s.is_decode)
        return self.metadata(shape, num_decodes)

    def _fill_sequences(
        self,
        scheduled: Sequence[ScheduledRequest],
        query_lens: np.ndarray,
        computed: np.ndarray,
        shape: StepShape,
    ) -> None:
        host, num_seqs, padded = self.host, shape.num_seqs, shape.num_seqs_padded
        host["query_start_loc"][0] = 0
        np.cumsum(query_lens, out=host["query_start_loc"][1 : num_seqs + 1])
        host["query_start_loc"][num_seqs + 1 : padded + 1] = shape.num_tokens  # length 0
        host["seq_lens"][:num_seqs] = computed + query_lens
        host["seq_lens"][num_seqs:padded] = 0
        host["block_tables"][:padded] = 0
        for row, item in enumerate(scheduled):
            block_ids = item.request.block_ids
            host["block_tables"][row, : len(block_ids)] = block_ids
        slots = [item.request.state_slot or 0 for item in scheduled]
        host["state_indices"][:num_seqs] = slots
        host["state_indices"][num_seqs:padded] = 0  # the null slot, never read back
        host["has_initial_state"][:num_seqs] = computed > 0
        host["has_initial_state"][num_seqs:padded] = False

    def _fill_tokens(
        self,
        scheduled: Sequence[ScheduledRequest],
        query_lens: np.ndarray,
        computed: np.ndarray,
        shape: StepShape,
        block_size: int,
    ) -> None:
        host, num_tokens, padded = self.host, shape.num_tokens, shape.num_tokens_padded
        offset = 0
        for item in scheduled:
            new_ids = item.new_token_ids
            host["input_ids"][offset : offset + len(new_ids)] = new_ids
            offset += len(new_ids)
        starts = host["query_start_loc"][: shape.num_seqs].astype(np.int64)
        request_index = np.repeat(np.arange(shape.num_seqs), query_lens)  # (T,)
        positions = np.arange(num_tokens) - starts[request_index] + computed[request_index]
        host["positions"][:num_tokens] = positions
        blocks = host["block_tables"][request_index, positions // block_size]
        host["slot_mapping"][:num_tokens] = (
            blocks.astype(np.int64) * block_size + positions % block_size
        )
        host["input_ids"][num_tokens:padded] = 0
        host["positions"][num_tokens:padded] = 0
        host["slot_mapping"][num_tokens:padded] = -1  # padded tokens are never stored

    def prepare_dummy(self, shape: StepShape, uniform_decode: bool = False) -> AttentionMetadata:
        """``num_seqs`` fresh sequences sharing the tokens, writing nothing to the caches.

        ``uniform_decode`` (one token per sequence) marks every sequence a decode, so a captured
        decode graph records the Mamba decode kernels; like every dummy run they read and write
        only the null state slot 0.
        """
        host, num_seqs, padded_seqs = self.host, shape.num_seqs, shape.num_seqs_padded
        query_lens = np.full(num_seqs, shape.num_tokens // num_seqs, dtype=np.int64)
        query_lens[: shape.num_tokens % num_seqs] += 1  # spread the remainder: none too long
        host["query_start_loc"][0] = 0
        np.cumsum(query_lens, out=host["query_start_loc"][1 : num_seqs + 1])
        host["query_start_loc"][num_seqs + 1 : padded_seqs + 1] = shape.num_tokens
        host["seq_lens"][:num_seqs] = query_lens
        host["seq_lens"][num_seqs:padded_seqs] = 0
        host["block_tables"][:padded_seqs] = 0
        host["state_indices"][:padded_seqs] = 0  # dummy runs only touch the null state slot
        host["has_initial_state"][:padded_seqs] = False
        host["input_ids"][: shape.num_tokens_padded] = 0
        host["positions"][: shape.num_tokens_padded] = 0
        host["slot_mapping"][: shape.num_tokens_padded] = -1
        self._copy_to_device(shape)
        return self.metadata(shape, num_decodes=padded_seqs if uniform_decode else 0)

    def _copy_to_device(self, shape: StepShape) -> None:
        rows = {
            "input_ids": shape.num_tokens_padded,
            "positions": shape.num_tokens_padded,
            "slot_mapping": shape.num_tokens_padded,
            "query_start_loc": shape.num_seqs_padded + 1,
        }
        for name, device_buffer in self.device_buffers.items():
            count = rows.get(name, shape.num_seqs_padded)
            device_buffer[:count].copy_(self.host_buffers[name][:count], non_blocking=True)

    def metadata(self, shape: StepShape, num_decodes: int) -> AttentionMetadata:
        seqs, tokens = shape.num_seqs_padded, shape.num_tokens_padded
        return AttentionMetadata(
            num_actual_tokens=shape.num_tokens,
            max_query_len=shape.max_query_len,
            query_start_loc=self["query_start_loc"][: seqs + 1],
            seq_lens=self["seq_lens"][:seqs],
            block_tables=self["block_tables"][:seqs],
            slot_mapping=self["slot_mapping"][:tokens],
            state_indices=self["state_indices"][:seqs],
            has_initial_state=self["has_initial_state"][:seqs],
            num_decodes=num_decodes,
        )
