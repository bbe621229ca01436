"""``VerifyBatch``: where a speculative step's logits rows and proposals sit, as device tensors.

The runner computes logits for ``1 + s`` rows of each producing request that verifies ``s``
proposals (``StepInputs`` lays them out, request after request) and one row for every other
producing request. Verification works on a ``(S, C)`` matrix, ``C = 1 + max s``: column ``j`` of
request ``i`` reads logits row ``index[i, j]`` (the last row of the request repeated past its own
``1 + s``), and ``proposals[i, j]`` is its ``j``-th proposal (-1 past its ``s``). Built on the host
with numpy and copied in one transfer.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from pieceworks.scheduler.output import SchedulerOutput


@dataclasses.dataclass
class VerifyBatch:
    """One speculative step's verify layout on the device."""

    index: torch.Tensor  # (S, C) int64: the logits row of each column
    proposals: torch.Tensor  # (S, C - 1) int64: proposals, -1 past each request's own
    num_proposals: torch.Tensor  # (S,) int64
    counts: list[int]  # per request: its logits rows (1 + its proposals)

    @property
    def num_columns(self) -> int:
        return self.index.shape[1]

    @classmethod
    def build(cls, output: SchedulerOutput, device: torch.device) -> VerifyBatch:
        """The layout of ``output``'s producing requests, in their scheduled order."""
        producing, columns = output.producing_requests, output.num_verify_columns
        counts = np.array([1 + len(item.spec_token_ids) for item in producing], dtype=np.int64)
        first_row = np.cumsum(counts) - counts  # (S,)
        packed = np.full((len(producing), 2 * columns), -1, dtype=np.int64)  # index | proposals
        column = np.arange(columns)
        packed[:, :columns] = first_row[:, None] + np.minimum(column[None, :], counts[:, None] - 1)
        for row, item in enumerate(producing):
            packed[row, columns : columns + len(item.spec_token_ids)] = item.spec_token_ids
        on_device = torch.from_numpy(packed).to(device)
        return cls(
            index=on_device[:, :columns],
            proposals=on_device[:, columns : 2 * columns - 1],
            num_proposals=torch.from_numpy(counts - 1).to(device),
            counts=counts.tolist(),
        )


def verify_rows(output: SchedulerOutput, rows: torch.Tensor) -> torch.Tensor:
    """``rows`` ``(S, ...)``, one per producing request, repeated for each of its logits rows
    (``1 + s`` for a request verifying ``s`` proposals); ``rows`` itself in a step without
    proposals."""
    if output.num_verify_columns == 1:
        return rows
    counts = [1 + len(item.spec_token_ids) for item in output.producing_requests]
    return rows.repeat_interleave(torch.tensor(counts, device=rows.device), dim=0)
