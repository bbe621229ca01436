"""Triton chunked SSD (Mamba2 state-space duality) scan for a packed ragged prefill.

Same semantics as ``reference.ssm_scan_ref``. Each program owns one (sequence, head, headdim block)
and walks that sequence's tokens in chunks of ``chunk_size`` starting at the sequence's own first
token, so packed sequences never share a chunk. The running state ``(dstate, headdim)`` stays in
registers between chunks (the inter-chunk state passing); within a chunk, with ``cum`` the
inclusive cumulative sum of ``dt * A``::

    y     = ((C @ B^T) * exp(cum_i - cum_j) * dt_j * [j <= i]) @ x     # intra-chunk, (L, P)
          + exp(cum_i) * (C @ state)                                   # carried state, (L, P)
          + D * x
    state = exp(cum_last) * state + B^T @ (x * exp(cum_last - cum_j) * dt_j)

All products are ``tl.dot`` in the input dtype (float32 operands use IEEE precision) with float32
accumulation. Parallelism is sequences x heads x headdim blocks; a sequence's chunks run in order.
The grid comes from shapes only and per-sequence metadata is read on the device (no host sync).
Scalar predicates enter masks as ``tl.where(flag, mask, False)`` (see ``causal_conv1d``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pieceworks.kernels.mamba.selective_state_update import discretize_dt
from pieceworks.kernels.triton_launch import launch

# Measured on an H200 at Bamba-9B shapes: 32-token chunks and a whole head (headdim 64) per
# program. 64-token chunks were ~1.6x slower on a two-sequence 2k/8k prefill, ~5% faster on one.
DEFAULT_CHUNK_SIZE = 32
_MAX_BLOCK_HEADDIM = 64
_NUM_WARPS = 4


@triton.jit
def _scan_chunk(
    state, chunk_start, seq_end, head, group, A, D, dt_bias, dt_min, dt_max,
    x_ptr, dt_ptr, B_ptr, C_ptr, y_ptr, headdim, dstate,
    stride_x_t, stride_x_h, stride_x_p, stride_dt_t, stride_dt_h,
    stride_B_t, stride_B_g, stride_B_n, stride_C_t, stride_C_g, stride_C_n,
    stride_y_t, stride_y_h, stride_y_p, offs_p,
    CHUNK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Write y for one chunk of tokens [chunk_start, seq_end); return the state at its end."""
    offs_l = tl.arange(0, CHUNK_SIZE)  # (L,)
    offs_n = tl.arange(0, BLOCK_N)  # (N,)
    offs_t = chunk_start + offs_l
    mask_t = offs_t < seq_end
    mask_tp = mask_t[:, None] & (offs_p < headdim)[None, :]
    mask_tn = mask_t[:, None] & (offs_n < dstate)[None, :]
    x_ptrs = x_ptr + offs_t[:, None] * stride_x_t + head * stride_x_h + offs_p[None, :] * stride_x_p
    x = tl.load(x_ptrs, mask=mask_tp, other=0.0)  # (L, P)
    B_ptrs = (
        B_ptr + offs_t[:, None] * stride_B_t + group * stride_B_g + offs_n[None, :] * stride_B_n
    )
    B = tl.load(B_ptrs, mask=mask_tn, other=0.0).to(x.dtype)  # (L, N)
    C_ptrs = (
        C_ptr + offs_t[:, None] * stride_C_t + group * stride_C_g + offs_n[None, :] * stride_C_n
    )
    C = tl.load(C_ptrs, mask=mask_tn, other=0.0).to(x.dtype)  # (L, N)
    dt = tl.load(dt_ptr + offs_t * stride_dt_t + head * stride_dt_h, mask=mask_t, other=0.0)
    dt = tl.where(mask_t, discretize_dt(dt, dt_bias, dt_min, dt_max), 0.0)  # (L,)
    cum = tl.cumsum(dt * A, axis=0)  # (L,) padded tokens add 0, so cum[-1] is the chunk total
    cum_last = tl.sum(tl.where(offs_l == CHUNK_SIZE - 1, cum, 0.0), axis=0)

    causal = offs_l[:, None] >= offs_l[None, :]
    decay = tl.exp(tl.where(causal, cum[:, None] - cum[None, :], float("-inf")))  # (L, L)
    scores = tl.dot(C, tl.trans(B), input_precision="ieee") * decay * dt[None, :]  # (L, L)
    y = tl.dot(scores.to(x.dtype), x, input_precision="ieee")  # (L, P)
    carried = tl.dot(C, state.to(x.dtype), input_precision="ieee")  # (L, P)
    y += tl.exp(cum)[:, None] * carried + D * x.to(tl.float32)
    y_ptrs = y_ptr + offs_t[:, None] * stride_y_t + head * stride_y_h + offs_p[None, :] * stride_y_p
    tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=mask_tp)

    weights = tl.exp(cum_last - cum) * dt  # (L,) how much each token reaches the chunk end
    x_weighted = (x.to(tl.float32) * weights[:, None]).to(x.dtype)
    return state * tl.exp(cum_last) + tl.dot(tl.trans(B), x_weighted, input_precision="ieee")


@triton.jit
def _chunk_scan_varlen_kernel(
    x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, dt_bias_ptr, y_ptr, ssm_state_ptr,
    query_start_loc_ptr, state_indices_ptr, has_initial_state_ptr,
    headdim, dstate, heads_per_group, dt_min, dt_max,
    stride_x_t, stride_x_h, stride_x_p, stride_dt_t, stride_dt_h,
    stride_B_t, stride_B_g, stride_B_n, stride_C_t, stride_C_g, stride_C_n,
    stride_y_t, stride_y_h, stride_y_p, stride_s_slot, stride_s_h, stride_s_p, stride_s_n,
    HAS_D: tl.constexpr, HAS_DT_BIAS: tl.constexpr, CHUNK_SIZE: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    seq, head = tl.program_id(0), tl.program_id(1)
    group = head // heads_per_group
    offs_p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)  # (P,)
    offs_n = tl.arange(0, BLOCK_N)  # (N,)
    seq_start = tl.load(query_start_loc_ptr + seq)
    seq_end = tl.load(query_start_loc_ptr + seq + 1)
    slot = tl.load(state_indices_ptr + seq).to(tl.int64)
    use_state = (tl.load(has_initial_state_ptr + seq) != 0) & (slot >= 0)
    # The state is held transposed, (dstate, headdim), so that C @ state needs no transpose.
    state_ptrs = (ssm_state_ptr + tl.maximum(slot, 0) * stride_s_slot + head * stride_s_h
                  + offs_n[:, None] * stride_s_n + offs_p[None, :] * stride_s_p)  # fmt: skip
    state_mask = (offs_n < dstate)[:, None] & (offs_p < headdim)[None, :]
    load_mask = tl.where(use_state, state_mask, False)
    state = tl.load(state_ptrs, mask=load_mask, other=0.0).to(tl.float32)  # (N, P)

    A = tl.load(A_ptr + head).to(tl.float32)
    D = tl.load(D_ptr + head).to(tl.float32) if HAS_D else 0.0
    dt_bias = tl.load(dt_bias_ptr + head).to(tl.float32) if HAS_DT_BIAS else 0.0
    for chunk_start in range(seq_start, seq_end, CHUNK_SIZE):
        state = _scan_chunk(
            state, chunk_start, seq_end, head, group, A, D, dt_bias, dt_min, dt_max,
            x_ptr, dt_ptr, B_ptr, C_ptr, y_ptr, headdim, dstate,
            stride_x_t, stride_x_h, stride_x_p, stride_dt_t, stride_dt_h,
            stride_B_t, stride_B_g, stride_B_n, stride_C_t, stride_C_g, stride_C_n,
            stride_y_t, stride_y_h, stride_y_p, offs_p,
            CHUNK_SIZE=CHUNK_SIZE, BLOCK_N=BLOCK_N,
        )  # fmt: skip
    store_mask = tl.where((slot >= 0) & (seq_end > seq_start), state_mask, False)
    tl.store(state_ptrs, state.to(ssm_state_ptr.dtype.element_ty), mask=store_mask)


def mamba_chunk_scan_varlen(
    x: torch.Tensor,  # (T, nheads, headdim)
    dt: torch.Tensor,  # (T, nheads), before softplus
    A: torch.Tensor,  # (nheads,), already -exp(A_log)
    B: torch.Tensor,  # (T, ngroups, dstate)
    C: torch.Tensor,  # (T, ngroups, dstate)
    D: torch.Tensor | None,  # (nheads,)
    dt_bias: torch.Tensor | None,  # (nheads,)
    ssm_state: torch.Tensor,  # (num_slots, nheads, headdim, dstate), mutated
    query_start_loc: torch.Tensor,  # (S + 1,) int32
    state_indices: torch.Tensor,  # (S,) int32
    has_initial_state: torch.Tensor,  # (S,) bool
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    out: torch.Tensor | None = None,  # (T, nheads, headdim), written in place when given
) -> torch.Tensor:
    """Selective scan of a packed ragged batch; returns y (T, nheads, headdim) in x.dtype.

    Sequence s starts from ``ssm_state[state_indices[s]]`` when ``has_initial_state[s]``, else
    from zeros, and leaves its final state in that slot. Zero-length sequences touch nothing.
    ``chunk_size`` must be a power of two >= 16.
    """
    num_tokens, num_heads, head_dim = x.shape
    num_seqs, dstate = state_indices.shape[0], B.shape[2]
    y = out if out is not None else torch.empty_like(x, memory_format=torch.contiguous_format)
    if num_tokens == 0 or num_seqs == 0:
        return y
    block_p = max(16, min(triton.next_power_of_2(head_dim), _MAX_BLOCK_HEADDIM))
    grid = (num_seqs, num_heads, triton.cdiv(head_dim, block_p))
    launch(_chunk_scan_varlen_kernel, grid,
        x, dt, A, B, C, D if D is not None else A, dt_bias if dt_bias is not None else A, y,
        ssm_state, query_start_loc, state_indices, has_initial_state,
        head_dim, dstate, num_heads // B.shape[1], float(dt_limit[0]), float(dt_limit[1]),
        *x.stride(), *dt.stride(), *B.stride(), *C.stride(), *y.stride(), *ssm_state.stride(),
        HAS_D=D is not None, HAS_DT_BIAS=dt_bias is not None, CHUNK_SIZE=chunk_size,
        BLOCK_P=block_p, BLOCK_N=max(16, triton.next_power_of_2(dstate)), num_warps=_NUM_WARPS,
    )  # fmt: skip
    return y
