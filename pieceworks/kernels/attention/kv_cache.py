"""Writing new key/value rows into the paged KV cache.

Owns `store_kv_cache`: scatter this step's K/V, one row per token, into the paged caches at the
slots the scheduler chose (`slot = block_id * block_size + offset`). A slot of -1 marks a padded
token (the runner pads a batch up to a captured graph size) and is never written, so padded rows
stay inert. It does not own the cache allocation or the slot assignment (the block manager's), nor
reading the cache back (`triton_attention.py`, `reference.py`).

Two implementations with one contract: `store_kv_cache_triton` (one program per token, no host
sync, so it can sit inside a captured graph) and `store_kv_cache_torch` (plain indexing, any device;
its boolean mask syncs with the host, so it is the CPU/reference path, not a graph path).
`plan_store_kv_cache` is the Triton path's shape work alone (checks, grid, strides), so a caller
that sees one shape many times (the attention layer) does it once and reuses the launch.
"""

import torch
import triton
import triton.language as tl

from pieceworks.kernels.kernel_launch import KernelLaunch


def store_kv_cache_torch(
    key: torch.Tensor,  # (T, Hkv, D)
    value: torch.Tensor,  # (T, Hkv, D)
    key_cache: torch.Tensor,  # (num_blocks, block_size, Hkv, D)
    value_cache: torch.Tensor,  # (num_blocks, block_size, Hkv, D)
    slot_mapping: torch.Tensor,  # (T,) int64, -1 = padded token
) -> None:
    """Scatter K/V rows into the caches with torch indexing, skipping slots < 0."""
    num_slots = key_cache.shape[0] * key_cache.shape[1]
    is_real = slot_mapping >= 0  # (T,)
    slots = slot_mapping[is_real]  # (T_real,)
    key_cache.view(num_slots, *key_cache.shape[2:])[slots] = key[is_real].to(key_cache.dtype)
    value_cache.view(num_slots, *value_cache.shape[2:])[slots] = value[is_real].to(
        value_cache.dtype
    )


@triton.jit
def _store_kv_cache_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
    stride_key_t,
    stride_key_h,
    stride_value_t,
    stride_value_h,
    stride_cache_block,
    stride_cache_offset,
    stride_cache_h,
    num_kv_heads,
    head_size,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # One program copies every head of one token's K and V row into its cache slot.
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # padded token: leave the cache untouched
        return
    block_id = slot // BLOCK_SIZE
    block_offset = slot % BLOCK_SIZE

    heads = tl.arange(0, BLOCK_H)[:, None]  # (BLOCK_H, 1)
    dims = tl.arange(0, BLOCK_D)[None, :]  # (1, BLOCK_D)
    mask = (heads < num_kv_heads) & (dims < head_size)

    key = tl.load(key_ptr + token * stride_key_t + heads * stride_key_h + dims, mask=mask)
    value = tl.load(value_ptr + token * stride_value_t + heads * stride_value_h + dims, mask=mask)
    cache_offsets = (
        block_id * stride_cache_block + block_offset * stride_cache_offset + heads * stride_cache_h
    ) + dims
    tl.store(key_cache_ptr + cache_offsets, key.to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(value_cache_ptr + cache_offsets, value.to(value_cache_ptr.dtype.element_ty), mask=mask)


def store_kv_cache_triton(
    key: torch.Tensor,  # (T, Hkv, D)
    value: torch.Tensor,  # (T, Hkv, D)
    key_cache: torch.Tensor,  # (num_blocks, block_size, Hkv, D)
    value_cache: torch.Tensor,  # (num_blocks, block_size, Hkv, D)
    slot_mapping: torch.Tensor,  # (T,) int64, -1 = padded token
) -> None:
    """Scatter K/V rows into the caches with one Triton program per token (graph-capturable)."""
    launch = plan_store_kv_cache(key, value, key_cache, value_cache, slot_mapping)
    if launch is not None:
        launch(key, value, key_cache, value_cache, slot_mapping)


def plan_store_kv_cache(
    key: torch.Tensor,  # (T, Hkv, D)
    value: torch.Tensor,  # (T, Hkv, D)
    key_cache: torch.Tensor,  # (num_blocks, block_size, Hkv, D)
    value_cache: torch.Tensor,  # (num_blocks, block_size, Hkv, D)
    slot_mapping: torch.Tensor,  # (T,) int64, -1 = padded token
) -> KernelLaunch | None:
    """Check the layouts and bind the store's launch; None when there is no token to store.

    The launch serves any tensors of these shapes and strides:
    ``launch(key, value, key_cache, value_cache, slot_mapping)``.
    """
    num_tokens, num_kv_heads, head_size = key.shape
    _check_store_shapes(key, value, key_cache, value_cache, slot_mapping)
    if num_tokens == 0:
        return None
    scalars = (
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        num_kv_heads,
        head_size,
    )
    options = dict(
        BLOCK_SIZE=key_cache.shape[1],
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_size),
    )
    return KernelLaunch(_store_kv_cache_kernel, (num_tokens,), scalars, options)


def store_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store K/V into the paged caches: Triton kernel (the default, capturable path)."""
    store_kv_cache_triton(key, value, key_cache, value_cache, slot_mapping)


def _check_store_shapes(key, value, key_cache, value_cache, slot_mapping) -> None:
    """Reject layouts the kernel cannot address: it assumes unit stride along D and equal caches."""
    if key.shape != value.shape or key_cache.shape != value_cache.shape:
        raise ValueError(
            f"key/value shapes {tuple(key.shape)}/{tuple(value.shape)} and cache shapes "
            f"{tuple(key_cache.shape)}/{tuple(value_cache.shape)} must match pairwise"
        )
    if key_cache.stride() != value_cache.stride():
        raise ValueError("key_cache and value_cache must share one memory layout")
    if key.shape[1:] != key_cache.shape[2:] or slot_mapping.shape != key.shape[:1]:
        raise ValueError(
            f"key {tuple(key.shape)} must be (T, Hkv, D) matching cache "
            f"{tuple(key_cache.shape)} = (num_blocks, block_size, Hkv, D), and slot_mapping "
            f"{tuple(slot_mapping.shape)} must be (T,)"
        )
    if key.stride(2) != 1 or value.stride(2) != 1 or key_cache.stride(3) != 1:
        raise ValueError("key, value and the caches must be contiguous along the head dimension")
