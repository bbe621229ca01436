"""Attention backends: the kernels a platform picks for the attention layer.

``current_platform().attention_backend()`` returns one of these classes (by qualname); the layer
calls ``store_kv`` then ``forward`` and never branches on hardware. Both take the step's
``AttentionMetadata`` and write into tensors they are given; neither allocates per call.
"""

from __future__ import annotations

import torch

from pieceworks.models.attention.metadata import AttentionMetadata
from pieceworks.models.attention.ops import (
    paged_attention_reference,
    paged_attention_triton,
    store_kv_cache_torch,
    store_kv_cache_triton,
)


class AttentionBackend:
    """Interface: store this step's K/V in the paged cache, then attend."""

    name = "base"

    @staticmethod
    def store_kv(
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> None:
        raise NotImplementedError

    @staticmethod
    def forward(
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        output: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> None:
        raise NotImplementedError


class TorchAttentionBackend(AttentionBackend):
    """The float32 torch reference: CPU, and the oracle in tests."""

    name = "torch"

    @staticmethod
    def store_kv(key, value, key_cache, value_cache, metadata) -> None:
        store_kv_cache_torch(key, value, key_cache, value_cache, metadata.slot_mapping)

    @staticmethod
    def forward(query, key_cache, value_cache, output, metadata, scale) -> None:
        paged_attention_reference(
            query,
            key_cache,
            value_cache,
            output,
            query_start_loc=metadata.query_start_loc,
            seq_lens=metadata.seq_lens,
            block_tables=metadata.block_tables,
            scale=scale,
        )


class TritonAttentionBackend(AttentionBackend):
    """Triton kernels (CUDA and ROCm): prefill, decode and mixed batches, FULL-graph capturable."""

    name = "triton"

    @staticmethod
    def store_kv(key, value, key_cache, value_cache, metadata) -> None:
        store_kv_cache_triton(key, value, key_cache, value_cache, metadata.slot_mapping)

    @staticmethod
    def forward(query, key_cache, value_cache, output, metadata, scale) -> None:
        paged_attention_triton(
            query,
            key_cache,
            value_cache,
            output,
            query_start_loc=metadata.query_start_loc,
            seq_lens=metadata.seq_lens,
            block_tables=metadata.block_tables,
            scale=scale,
            max_query_len=metadata.max_query_len,
        )
