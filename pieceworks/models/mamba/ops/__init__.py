"""Mamba2 mixer-core ops: Triton kernels for prefill and decode, and their float32 torch references.

Prefill (packed ragged, optionally continuing from the per-slot caches): ``causal_conv1d_varlen``
then ``mamba_chunk_scan_varlen``. Decode (one token per sequence, graph-capturable):
``causal_conv1d_update`` then ``selective_state_update``. The ``*_ref`` functions define the
semantics all of them share; see ``reference`` for the batch conventions. The Triton kernels live
in ``pieceworks.kernels.mamba``.
"""

from pieceworks.kernels.mamba.causal_conv1d import causal_conv1d_update, causal_conv1d_varlen
from pieceworks.kernels.mamba.selective_state_update import selective_state_update
from pieceworks.kernels.mamba.ssd_scan import DEFAULT_CHUNK_SIZE, mamba_chunk_scan_varlen
from pieceworks.models.mamba.ops.reference import (
    causal_conv1d_ref,
    gated_rms_norm_ref,
    ssm_scan_ref,
)

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "causal_conv1d_ref",
    "causal_conv1d_update",
    "causal_conv1d_varlen",
    "gated_rms_norm_ref",
    "mamba_chunk_scan_varlen",
    "selective_state_update",
    "ssm_scan_ref",
]
