"""Attention ops: the paged-KV store and paged attention, in Triton and in plain torch.

The Triton kernels live in ``pieceworks.kernels.attention``; this package names them beside the
torch reference (``reference.py``) for the attention layer. Owns the low-level ops only; choosing
between them (Triton on GPUs, the torch reference on CPU) belongs to the platform and the
attention backend that call them. The Triton ops come in two
forms: one call (`store_kv_cache_triton`, `paged_attention_triton`) and its shape work alone
(`plan_store_kv_cache`, `plan_paged_attention`), whose launch a caller reuses per shape.
"""

from pieceworks.kernels.attention.kv_cache import (
    plan_store_kv_cache,
    store_kv_cache,
    store_kv_cache_torch,
    store_kv_cache_triton,
)
from pieceworks.kernels.attention.triton_attention import (
    DecodeLaunch,
    PagedAttentionLaunch,
    choose_num_kv_splits,
    paged_attention_triton,
    plan_paged_attention,
)
from pieceworks.kernels.attention.workspace import DecodeWorkspace
from pieceworks.kernels.kernel_launch import KernelLaunch
from pieceworks.models.attention.ops.reference import paged_attention_reference

__all__ = [
    "DecodeLaunch",
    "DecodeWorkspace",
    "KernelLaunch",
    "PagedAttentionLaunch",
    "choose_num_kv_splits",
    "paged_attention_reference",
    "paged_attention_triton",
    "plan_paged_attention",
    "plan_store_kv_cache",
    "store_kv_cache",
    "store_kv_cache_torch",
    "store_kv_cache_triton",
]
