"""``DecodeWorkspace``: the split-KV decode scratch, allocated once and shared by every layer.

The split-KV decode writes one partial output and one log-sum-exp per (sequence, q head, split
that holds part of the context), and its reduce kernel reads them back at once; the rows of empty
splits are neither written nor read. Allocating that scratch per call costs host time on
every layer of every step; this object hands out views of one float32 buffer instead, the same
views for the same shape every time, so a captured graph and a later eager call agree on the
address.

Sharing one buffer between layers (and between shapes) is safe because every kernel that touches
it runs on one stream, in order: a layer's reduce has read the scratch before the next layer's
split kernel writes it, and two graphs never replay at once. The buffer only grows: when a shape
needs more than it holds, a buffer at least twice as large replaces it for new shapes, and the
old one stays alive through the views already handed out (a graph captured with them keeps
reading valid memory). Graphs are captured largest batch first, so the first buffer usually
fits every later shape.
Hardware-neutral: plain torch, no kernels; the Triton decode path is its only user.
"""

from __future__ import annotations

import torch

WorkspaceKey = tuple[int, int, int, int, torch.device]


class DecodeWorkspace:
    """Views ``(partial_out, partial_lse)`` of one grow-only float32 buffer, cached per shape."""

    def __init__(self) -> None:
        self._buffers: dict[torch.device, torch.Tensor] = {}
        self._views: dict[WorkspaceKey, tuple[torch.Tensor, torch.Tensor]] = {}

    def get(
        self,
        num_seqs: int,
        num_heads: int,
        num_kv_splits: int,
        head_size: int,
        device: torch.device,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Scratch for one decode shape: (S, Hq, splits, D) outputs and (S, Hq, splits) lse."""
        key = (num_seqs, num_heads, num_kv_splits, head_size, device)
        views = self._views.get(key)
        if views is None:
            views = self._views[key] = self._carve(*key)
        return views

    def _carve(
        self, num_seqs: int, num_heads: int, num_kv_splits: int, head_size: int, device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        num_rows = num_seqs * num_heads * num_kv_splits
        num_out = num_rows * head_size  # the lse block starts 64-byte aligned: head_size >= 16
        buffer = self._buffers.get(device)
        if buffer is None or buffer.numel() < num_out + num_rows:
            # At least double: an eager run meeting ever larger batches replaces the buffer a
            # few times, not once per batch size (each outgrown buffer stays alive).
            old_numel = 0 if buffer is None else buffer.numel()
            numel = max(num_out + num_rows, 2 * old_numel)
            buffer = torch.empty(numel, dtype=torch.float32, device=device)
            self._buffers[device] = buffer
        partial_out = buffer[:num_out].view(num_seqs, num_heads, num_kv_splits, head_size)
        partial_lse = buffer[num_out : num_out + num_rows].view(num_seqs, num_heads, num_kv_splits)
        return partial_out, partial_lse
