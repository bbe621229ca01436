"""Triton kernels for the Mamba2 depthwise causal conv1d (+ SiLU) with a per-slot conv cache.

Two entry points, same semantics as ``reference.causal_conv1d_ref``:

- ``causal_conv1d_varlen`` for a packed ragged prefill (sequences may continue from their cache);
- ``causal_conv1d_update`` for one decode token per sequence, capturable in a static graph.

The conv cache of a slot holds the last ``d_conv - 1`` inputs of xBC before the conv, oldest first:
``conv_state (num_slots, conv_dim, d_conv - 1)``. A negative slot index means "no cache" (start from
zeros, write nothing). Grids come from tensor shapes only, and all per-sequence metadata is read on
the device, so neither op syncs with the host. Buffers are accessed through their strides, so the
xBC argument may be a column slice of the in_proj output.

Scalar predicates are folded into vector masks as ``tl.where(flag, mask, False)`` rather than
``mask & flag``: Triton's CPU interpreter types ``vector & scalar`` bool masks as int32 and
rejects them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pieceworks.kernels.triton_launch import launch

# Tile sizes measured best on an H200 at Bamba-9B shapes (conv_dim 8448, 2k-8k token prefills).
_BLOCK_TOKENS = 32
_BLOCK_CHANNELS = 128


@triton.jit
def _sequence_of_tokens(query_start_loc_ptr, offs_t, num_seqs):
    """Index of the sequence each packed token belongs to: the last s with start[s] <= t."""
    seq_idx = tl.zeros_like(offs_t)
    for s in range(1, num_seqs):
        seq_idx += (tl.load(query_start_loc_ptr + s) <= offs_t).to(offs_t.dtype)
    return seq_idx


@triton.jit
def _add_cache_taps(
    acc, conv_state_ptr, weight_ptr, slot, position, cache_rows, offs_d, mask_d,
    stride_s_slot, stride_s_d, stride_s_k, stride_w_d, stride_w_k, KERNEL_WIDTH: tl.constexpr,
):  # fmt: skip
    """Add the taps that reach back before a sequence's first token into its conv cache."""
    for k in tl.static_range(KERNEL_WIDTH - 1):  # the last tap always reads the token itself
        source = position + k - (KERNEL_WIDTH - 1)  # (BLOCK_T,) negative: a cache column
        from_cache = (source < 0) & cache_rows
        column = tl.where(from_cache, source + KERNEL_WIDTH - 1, 0)
        s_ptrs = conv_state_ptr + slot[:, None] * stride_s_slot + column[:, None] * stride_s_k
        s_val = tl.load(s_ptrs + offs_d[None, :] * stride_s_d,
                        mask=from_cache[:, None] & mask_d[None, :], other=0.0)  # fmt: skip
        w = tl.load(weight_ptr + offs_d * stride_w_d + k * stride_w_k, mask=mask_d, other=0.0)
        acc += s_val.to(tl.float32) * w.to(tl.float32)[None, :]
    return acc


@triton.jit
def _causal_conv1d_varlen_kernel(
    xBC_ptr, weight_ptr, bias_ptr, conv_state_ptr, out_ptr,
    query_start_loc_ptr, state_indices_ptr, has_initial_state_ptr,
    num_tokens, num_seqs, conv_dim,
    stride_x_t, stride_x_d, stride_w_d, stride_w_k,
    stride_s_slot, stride_s_d, stride_s_k, stride_o_t, stride_o_d,
    HAS_BIAS: tl.constexpr, KERNEL_WIDTH: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # (BLOCK_T,)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)  # (BLOCK_D,)
    mask_t = offs_t < num_tokens
    mask_d = offs_d < conv_dim
    seq_idx = _sequence_of_tokens(query_start_loc_ptr, offs_t, num_seqs)
    start = tl.load(query_start_loc_ptr + seq_idx, mask=mask_t, other=0)
    slot = tl.load(state_indices_ptr + seq_idx, mask=mask_t, other=-1).to(tl.int64)
    use_state = (tl.load(has_initial_state_ptr + seq_idx, mask=mask_t, other=0) != 0) & (slot >= 0)
    slot = tl.where(use_state, slot, 0)
    position = offs_t - start  # position of each token inside its sequence

    acc = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_d, mask=mask_d, other=0.0).to(tl.float32)[None, :]
    for k in tl.static_range(KERNEL_WIDTH):
        from_x = (position + k - (KERNEL_WIDTH - 1) >= 0) & mask_t
        x_ptrs = xBC_ptr + (offs_t + k - (KERNEL_WIDTH - 1))[:, None] * stride_x_t
        x_val = tl.load(x_ptrs + offs_d[None, :] * stride_x_d,
                        mask=from_x[:, None] & mask_d[None, :], other=0.0)  # fmt: skip
        w = tl.load(weight_ptr + offs_d * stride_w_d + k * stride_w_k, mask=mask_d, other=0.0)
        acc += x_val.to(tl.float32) * w.to(tl.float32)[None, :]
    # Only a tile holding one of a sequence's first d_conv - 1 tokens reads the cache; most skip it.
    cache_rows = mask_t & use_state
    if tl.min(tl.where(cache_rows, position, KERNEL_WIDTH), axis=0) < KERNEL_WIDTH - 1:
        acc = _add_cache_taps(
            acc, conv_state_ptr, weight_ptr, slot, position, cache_rows, offs_d, mask_d,
            stride_s_slot, stride_s_d, stride_s_k, stride_w_d, stride_w_k, KERNEL_WIDTH,
        )  # fmt: skip

    out = acc * tl.sigmoid(acc)
    out_ptrs = out_ptr + offs_t[:, None] * stride_o_t + offs_d[None, :] * stride_o_d
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask_t[:, None] & mask_d[None, :])


@triton.jit
def _conv_state_writeback_kernel(
    xBC_ptr, conv_state_ptr, query_start_loc_ptr, state_indices_ptr, has_initial_state_ptr,
    conv_dim, stride_x_t, stride_x_d, stride_s_slot, stride_s_d, stride_s_k,
    KERNEL_WIDTH: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """New cache of one sequence = last d_conv-1 entries of (old cache ++ its tokens)."""
    seq = tl.program_id(0)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)  # (BLOCK_D,)
    offs_k = tl.arange(0, BLOCK_K)  # (BLOCK_K,) destination column
    start = tl.load(query_start_loc_ptr + seq)
    seq_len = tl.load(query_start_loc_ptr + seq + 1) - start
    slot = tl.load(state_indices_ptr + seq).to(tl.int64)
    use_state = (tl.load(has_initial_state_ptr + seq) != 0) & (slot >= 0)
    mask_dk = (offs_d < conv_dim)[:, None] & (offs_k < KERNEL_WIDTH - 1)[None, :]
    source = seq_len + offs_k  # index into (old cache ++ tokens), cache occupying [0, d_conv-1)
    from_x = source >= KERNEL_WIDTH - 1
    x_ptrs = xBC_ptr + (start + source - (KERNEL_WIDTH - 1))[None, :] * stride_x_t
    x_val = tl.load(
        x_ptrs + offs_d[:, None] * stride_x_d, mask=mask_dk & from_x[None, :], other=0.0
    )
    cache_ptrs = conv_state_ptr + tl.maximum(slot, 0) * stride_s_slot + offs_d[:, None] * stride_s_d
    from_cache = tl.where(use_state, mask_dk & ~from_x[None, :], False)
    s_val = tl.load(cache_ptrs + source[None, :] * stride_s_k, mask=from_cache, other=0.0)
    # Other threads of this program read the columns we overwrite: finish every read first.
    tl.debug_barrier()
    new_state = (x_val.to(tl.float32) + s_val.to(tl.float32)).to(conv_state_ptr.dtype.element_ty)
    write_mask = tl.where((seq_len > 0) & (slot >= 0), mask_dk, False)
    tl.store(cache_ptrs + offs_k[None, :] * stride_s_k, new_state, mask=write_mask)


def causal_conv1d_varlen(
    xBC: torch.Tensor,  # (T, conv_dim)
    conv_weight: torch.Tensor,  # (conv_dim, d_conv)
    conv_bias: torch.Tensor | None,  # (conv_dim,)
    conv_state: torch.Tensor,  # (num_slots, conv_dim, d_conv - 1), mutated
    query_start_loc: torch.Tensor,  # (S + 1,) int32
    state_indices: torch.Tensor,  # (S,) int32
    has_initial_state: torch.Tensor,  # (S,) bool
    out: torch.Tensor | None = None,  # (T, conv_dim), written in place when given
) -> torch.Tensor:
    """Causal depthwise conv1d + SiLU over a packed ragged batch; returns (T, conv_dim), xBC.dtype.

    Sequence s starts from ``conv_state[state_indices[s]]`` when ``has_initial_state[s]``, else from
    zeros; afterwards that slot holds the last ``d_conv - 1`` inputs of the sequence (older cache
    entries shifted in when the sequence is shorter than that). Zero-length sequences touch nothing.
    """
    num_tokens, conv_dim = xBC.shape
    width = conv_weight.shape[1]
    num_seqs = state_indices.shape[0]
    if out is None:
        out = torch.empty((num_tokens, conv_dim), dtype=xBC.dtype, device=xBC.device)
    if num_tokens == 0 or num_seqs == 0:
        return out
    bias = conv_bias if conv_bias is not None else conv_weight  # placeholder pointer when absent
    grid = (triton.cdiv(num_tokens, _BLOCK_TOKENS), triton.cdiv(conv_dim, _BLOCK_CHANNELS))
    launch(_causal_conv1d_varlen_kernel, grid,
        xBC, conv_weight, bias, conv_state, out,
        query_start_loc, state_indices, has_initial_state,
        num_tokens, num_seqs, conv_dim,
        xBC.stride(0), xBC.stride(1), conv_weight.stride(0), conv_weight.stride(1),
        *conv_state.stride(), out.stride(0), out.stride(1),
        HAS_BIAS=conv_bias is not None, KERNEL_WIDTH=width,
        BLOCK_T=_BLOCK_TOKENS, BLOCK_D=_BLOCK_CHANNELS,
    )  # fmt: skip
    _write_back_conv_state(xBC, conv_state, query_start_loc, state_indices, has_initial_state)
    return out


def _write_back_conv_state(xBC, conv_state, query_start_loc, state_indices, has_initial_state):
    """Second launch: runs after every conv read of the old cache has completed."""
    conv_dim, width = xBC.shape[1], conv_state.shape[2] + 1
    grid = (state_indices.shape[0], triton.cdiv(conv_dim, _BLOCK_CHANNELS))
    launch(_conv_state_writeback_kernel, grid,
        xBC, conv_state, query_start_loc, state_indices, has_initial_state,
        conv_dim, xBC.stride(0), xBC.stride(1), *conv_state.stride(),
        KERNEL_WIDTH=width, BLOCK_K=triton.next_power_of_2(max(width - 1, 1)),
        BLOCK_D=_BLOCK_CHANNELS,
    )  # fmt: skip


@triton.jit
def _causal_conv1d_update_kernel(
    x_ptr, conv_state_ptr, weight_ptr, bias_ptr, out_ptr, state_indices_ptr, conv_dim,
    stride_x_s, stride_x_d, stride_s_slot, stride_s_d, stride_s_k,
    stride_w_d, stride_w_k, stride_o_s, stride_o_d,
    HAS_BIAS: tl.constexpr, KERNEL_WIDTH: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)  # (BLOCK_D,)
    offs_k = tl.arange(0, BLOCK_K)  # (BLOCK_K,) tap index over (cache ++ new token)
    mask_d = offs_d < conv_dim
    slot = tl.load(state_indices_ptr + seq).to(tl.int64)
    is_cached = slot >= 0
    cache_ptrs = conv_state_ptr + tl.maximum(slot, 0) * stride_s_slot + offs_d[:, None] * stride_s_d
    in_cache = (offs_k < KERNEL_WIDTH - 1)[None, :] & mask_d[:, None]
    in_cache = tl.where(is_cached, in_cache, False)
    history = tl.load(cache_ptrs + offs_k[None, :] * stride_s_k, mask=in_cache, other=0.0)
    x_new = tl.load(x_ptr + seq * stride_x_s + offs_d * stride_x_d, mask=mask_d, other=0.0)
    is_new = (offs_k == KERNEL_WIDTH - 1)[None, :]
    window = tl.where(is_new, x_new.to(tl.float32)[:, None], history.to(tl.float32))  # (D, K)

    w_mask = mask_d[:, None] & (offs_k < KERNEL_WIDTH)[None, :]
    w_ptrs = weight_ptr + offs_d[:, None] * stride_w_d + offs_k[None, :] * stride_w_k
    acc = tl.sum(window * tl.load(w_ptrs, mask=w_mask, other=0.0).to(tl.float32), axis=1)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    out = acc * tl.sigmoid(acc)
    tl.store(out_ptr + seq * stride_o_s + offs_d * stride_o_d, out.to(out_ptr.dtype.element_ty),
             mask=mask_d)  # fmt: skip

    # Shift left by one: tap k moves to cache column k - 1. Other threads read those columns.
    tl.debug_barrier()
    shifted_mask = mask_d[:, None] & ((offs_k >= 1) & (offs_k < KERNEL_WIDTH))[None, :]
    shifted_mask = tl.where(is_cached, shifted_mask, False)
    tl.store(cache_ptrs + (offs_k - 1)[None, :] * stride_s_k,
             window.to(conv_state_ptr.dtype.element_ty), mask=shifted_mask)  # fmt: skip


def causal_conv1d_update(
    x: torch.Tensor,  # (S, conv_dim), one new token per sequence
    conv_state: torch.Tensor,  # (num_slots, conv_dim, d_conv - 1), mutated
    weight: torch.Tensor,  # (conv_dim, d_conv)
    bias: torch.Tensor | None,  # (conv_dim,)
    state_indices: torch.Tensor,  # (S,) int32
    out: torch.Tensor | None = None,  # (S, conv_dim), written in place when given
) -> torch.Tensor:
    """One decode step of conv1d + SiLU; returns (S, conv_dim) in x.dtype.

    Row s convolves ``conv_state[state_indices[s]] ++ x[s]`` and shifts x[s] into that slot.
    A negative slot reads zeros and writes nothing. Graph-capturable (no host sync).
    """
    num_seqs, conv_dim = x.shape
    width = weight.shape[1]
    if out is None:
        out = torch.empty((num_seqs, conv_dim), dtype=x.dtype, device=x.device)
    if num_seqs == 0:
        return out
    grid = (num_seqs, triton.cdiv(conv_dim, _BLOCK_CHANNELS))
    launch(_causal_conv1d_update_kernel, grid,
        x, conv_state, weight, bias if bias is not None else weight, out, state_indices, conv_dim,
        x.stride(0), x.stride(1), *conv_state.stride(), weight.stride(0), weight.stride(1),
        out.stride(0), out.stride(1),
        HAS_BIAS=bias is not None, KERNEL_WIDTH=width,
        BLOCK_K=triton.next_power_of_2(width), BLOCK_D=_BLOCK_CHANNELS,
    )  # fmt: skip
    return out
