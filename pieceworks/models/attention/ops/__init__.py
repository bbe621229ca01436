"""Attention kernels: the paged-KV store and paged attention, in Triton and in plain torch.

Owns the low-level ops only; choosing between them (Triton on GPUs, the torch reference on CPU)
belongs to the platform and the attention backend that call them.
"""

from pieceworks.models.attention.ops.kv_cache import (
    store_kv_cache,
    store_kv_cache_torch,
    store_kv_cache_triton,
)
from pieceworks.models.attention.ops.reference import paged_attention_reference
from pieceworks.models.attention.ops.triton_attention import (
    allocate_decode_workspace,
    choose_num_kv_splits,
    paged_attention_triton,
)

__all__ = [
    "allocate_decode_workspace",
    "choose_num_kv_splits",
    "paged_attention_reference",
    "paged_attention_triton",
    "store_kv_cache",
    "store_kv_cache_torch",
    "store_kv_cache_triton",
]
