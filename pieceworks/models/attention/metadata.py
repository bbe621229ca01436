"""``AttentionMetadata``: one step's batch layout, as views of the runner's persistent buffers.

Every tensor here is a prefix view of a buffer the runner allocated once at its maximum size, so a
captured FULL graph reads the next step's values from the same addresses. Host ints are fixed per
captured descriptor (a uniform decode step always has ``max_query_len == 1``).
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass
class AttentionMetadata:
    num_actual_tokens: int  # real tokens; rows past it are padding (slot -1, never written)
    max_query_len: int  # >= every sequence's query length; 1 for a uniform decode step
    query_start_loc: torch.Tensor  # (S + 1,) int32, cumulative query lengths
    seq_lens: torch.Tensor  # (S,) int32, context length including this step's tokens
    block_tables: torch.Tensor  # (S, max_blocks_per_seq) int32
    slot_mapping: torch.Tensor  # (T,) int64, cache slot of each token; -1 for padded rows
    # Hybrid (Mamba2) models only.
    state_indices: torch.Tensor | None = None  # (S,) int32 state slot per sequence; 0 = null slot
    has_initial_state: torch.Tensor | None = None  # (S,) bool: continue from the saved state
    num_decodes: int = 0  # leading sequences with query length 1 and a saved state

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]
