"""``DecodeWorkspace``: the split-KV decode scratch, allocated once and shared by every layer.

The split-KV decode kernel writes one partial output and one log-sum-exp per (sequence, q head,
split), and counts the splits of each (sequence, kv head) in as they finish: the last one to
arrive reads every partial of its q heads back, merges them into the output and resets its
counter to zero. Allocating that scratch per call costs host time on every layer of every step;
this object hands out views of grow-only buffers instead (one float32 buffer for the partials,
one int32 buffer for the counters), the same views for the same shape every time, so a captured
graph and a later eager call agree on the addresses.

Sharing the buffers between layers (and between shapes) is safe because every kernel that
touches them runs on one stream, in order: a layer's launch has merged its partials and left
every counter at zero before the next layer's launch starts, and two graphs never replay at
once. The counters are zeroed once, when their buffer is allocated, and the kernel keeps them
zero between launches, so any prefix of the buffer serves any shape. A buffer only grows: when a
shape needs more than it holds, one at least twice as large replaces it for new shapes, and the
old one stays alive through the views already handed out (a graph captured with them keeps
reading valid memory). Graphs are captured largest batch first, so the first buffer usually
fits every later shape.
Hardware-neutral: plain torch, no kernels; the Triton decode path is its only user.
"""

from __future__ import annotations

import torch

WorkspaceKey = tuple[int, int, int, int, torch.device]
CountersKey = tuple[int, int, torch.device]


class DecodeWorkspace:
    """Views of grow-only buffers cached per shape: ``(partial_out, partial_lse)`` from one float32
    buffer, ``split_counters`` from one int32 buffer whose elements are zero between launches."""

    def __init__(self) -> None:
        self._buffers: dict[torch.device, torch.Tensor] = {}
        self._views: dict[WorkspaceKey, tuple[torch.Tensor, torch.Tensor]] = {}
        self._counter_buffers: dict[torch.device, torch.Tensor] = {}
        self._counter_views: dict[CountersKey, torch.Tensor] = {}

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

    def get_split_counters(
        self, num_seqs: int, num_kv_heads: int, device: torch.device
    ) -> torch.Tensor:
        """(S, Hkv) int32 arrival counters for one decode shape, all zero between launches."""
        key = (num_seqs, num_kv_heads, device)
        counters = self._counter_views.get(key)
        if counters is None:
            numel = num_seqs * num_kv_heads
            buffer = self._counter_buffers.get(device)
            if buffer is None or buffer.numel() < numel:
                _check_not_capturing(device)
                buffer = self._counter_buffers[device] = _grown(buffer, numel, torch.int32, device)
            counters = self._counter_views[key] = buffer[:numel].view(num_seqs, num_kv_heads)
        return counters

    def _carve(
        self, num_seqs: int, num_heads: int, num_kv_splits: int, head_size: int, device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        num_rows = num_seqs * num_heads * num_kv_splits
        num_out = num_rows * head_size  # the lse block starts 64-byte aligned: head_size >= 16
        numel = num_out + num_rows
        buffer = self._buffers.get(device)
        if buffer is None or buffer.numel() < numel:
            buffer = self._buffers[device] = _grown(buffer, numel, torch.float32, device)
        partial_out = buffer[:num_out].view(num_seqs, num_heads, num_kv_splits, head_size)
        partial_lse = buffer[num_out : num_out + num_rows].view(num_seqs, num_heads, num_kv_splits)
        return partial_out, partial_lse


def _grown(
    buffer: torch.Tensor | None, numel: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """A zeroed buffer replacing ``buffer``: at least ``numel`` elements and twice the old size.

    Doubling means an eager run meeting ever larger batches replaces the buffer a few times, not
    once per batch size (each outgrown buffer stays alive through its views).
    """
    old_numel = 0 if buffer is None else buffer.numel()
    return torch.zeros(max(numel, 2 * old_numel), dtype=dtype, device=device)


def _check_not_capturing(device: torch.device) -> None:
    """Counters must be zero in memory before any launch, which a zero-fill recorded into a graph
    being captured (and run only when that graph replays) does not guarantee."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "the split-KV decode counters for this shape would be allocated during CUDA graph "
            "capture; run the shape once eagerly (a warm-up) before capturing it"
        )
