"""How a Mamba2 mixer splits across tensor-parallel ranks: heads, groups, checkpoint rows.

Mamba heads are split (``mamba_n_heads % tp == 0``), and with them ``x``, ``z``, ``dt``, ``A_log``,
``D``, ``dt_bias``, the gated norm's weight and ``out_proj``'s input. The B/C groups are split when
``mamba_n_groups % tp == 0``; fewer groups than ranks are replicated (KV heads' rule): rank ``r``
holds group ``r * n_groups // tp``, the one its heads read. ``in_proj`` is one checkpoint tensor
laid out ``[z (I), x (I), B (G*N), C (G*N), dt (H)]`` and ``conv1d`` covers ``[x, B, C]``; a rank
keeps its rows of each part, in the same order, so the mixer code is the same at every tp size.
"""

from __future__ import annotations

import dataclasses

from pieceworks.models.layers.linear import divide, shard_or_replicate

Rows = list[tuple[int, int]]  # (start, length) ranges of a checkpoint tensor's rows


@dataclasses.dataclass(frozen=True)
class Mamba2Sharding:
    """One rank's slice of a mixer with the checkpoint's ``num_heads`` and ``num_groups``."""

    num_heads: int  # H, the checkpoint's mamba_n_heads
    head_dim: int  # P
    num_groups: int  # G, the checkpoint's mamba_n_groups
    state_size: int  # N
    tp_rank: int = 0
    tp_size: int = 1

    def __post_init__(self) -> None:
        divide(self.num_heads, self.tp_size, "mamba_n_heads")
        shard_or_replicate(self.num_groups, self.tp_rank, self.tp_size, "mamba_n_groups")

    @property
    def intermediate_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.intermediate_size + 2 * self.num_groups * self.state_size

    @property
    def in_proj_size(self) -> int:
        return self.intermediate_size + self.conv_dim + self.num_heads

    @property
    def num_local_heads(self) -> int:
        return self.num_heads // self.tp_size

    @property
    def local_intermediate_size(self) -> int:
        return self.num_local_heads * self.head_dim

    @property
    def group_start(self) -> int:
        return shard_or_replicate(self.num_groups, self.tp_rank, self.tp_size, "mamba_n_groups")[0]

    @property
    def num_local_groups(self) -> int:
        return shard_or_replicate(self.num_groups, self.tp_rank, self.tp_size, "mamba_n_groups")[1]

    @property
    def local_conv_dim(self) -> int:
        return self.local_intermediate_size + 2 * self.num_local_groups * self.state_size

    @property
    def local_in_proj_size(self) -> int:
        return self.local_intermediate_size + self.local_conv_dim + self.num_local_heads

    @property
    def norm_group_spans_ranks(self) -> bool:
        """Whether one norm group (``I / G`` channels) is split over several ranks."""
        return self.num_groups < self.tp_size

    def head_rows(self) -> Rows:
        """This rank's heads (``A_log``, ``D``, ``dt_bias``)."""
        return [(self.tp_rank * self.num_local_heads, self.num_local_heads)]

    def intermediate_rows(self, offset: int = 0) -> Rows:
        """This rank's channels of an ``(I,)`` part (``x``, ``z``, the norm's weight)."""
        size = self.local_intermediate_size
        return [(offset + self.tp_rank * size, size)]

    def conv_rows(self, offset: int = 0) -> Rows:
        """This rank's rows of ``xBC = [x (I), B (G*N), C (G*N)]`` starting at ``offset``."""
        group_width = self.num_groups * self.state_size
        group_start = offset + self.intermediate_size + self.group_start * self.state_size
        local_group_width = self.num_local_groups * self.state_size
        return [
            *self.intermediate_rows(offset),
            (group_start, local_group_width),  # B
            (group_start + group_width, local_group_width),  # C
        ]

    def in_proj_rows(self) -> Rows:
        """This rank's rows of ``in_proj = [z, x, B, C, dt]``, in that order."""
        dt_start = self.intermediate_size + self.conv_dim
        dt_rows = [(dt_start + start, length) for start, length in self.head_rows()]
        return [*self.intermediate_rows(), *self.conv_rows(self.intermediate_size), *dt_rows]
