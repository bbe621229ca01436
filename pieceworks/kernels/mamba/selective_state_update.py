"""Triton kernel for one Mamba2 decode step: update each sequence's SSM state in place, emit y.

Per head h (group g = h // (nheads // ngroups)) and sequence s with slot ``state_indices[s]``::

    dt    = clamp(softplus(dt[s, h] + dt_bias[h]), *dt_limit)
    state = state * exp(dt * A[h]) + dt * x[s, h] (outer) B[s, g]      # (headdim, dstate)
    y     = state @ C[s, g] + D[h] * x[s, h]                            # (headdim,)

This is ``reference.ssm_scan_ref`` for a batch of length-1 sequences that all continue from their
cache. It is graph-capturable: the grid comes from shapes and the slots are read on the device. A
negative slot starts from zeros and writes nothing (padded rows may also share a null slot whose
contents are garbage). ``discretize_dt`` is shared with the chunked prefill scan.
Scalar predicates enter masks as ``tl.where(flag, mask, False)`` (see ``causal_conv1d``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pieceworks.kernels.triton_launch import launch

_MAX_BLOCK_HEADDIM = 16


@triton.jit
def discretize_dt(dt, dt_bias, dt_min, dt_max):
    """clamp(softplus(dt + dt_bias), dt_min, dt_max) in float32; softplus is linear above 20."""
    dt = dt.to(tl.float32) + dt_bias
    dt = tl.where(dt <= 20.0, tl.log(1.0 + tl.exp(tl.minimum(dt, 20.0))), dt)
    return tl.minimum(tl.maximum(dt, dt_min), dt_max)


@triton.jit
def _selective_state_update_kernel(
    ssm_state_ptr, x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, dt_bias_ptr, y_ptr,
    state_indices_ptr, headdim, dstate, heads_per_group, dt_min, dt_max,
    stride_s_slot, stride_s_h, stride_s_p, stride_s_n,
    stride_x_s, stride_x_h, stride_x_p, stride_dt_s, stride_dt_h,
    stride_B_s, stride_B_g, stride_B_n, stride_C_s, stride_C_g, stride_C_n,
    stride_y_s, stride_y_h, stride_y_p,
    HAS_D: tl.constexpr, HAS_DT_BIAS: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    seq, head = tl.program_id(0), tl.program_id(1)
    group = head // heads_per_group
    offs_p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)  # (BLOCK_P,)
    offs_n = tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    mask_p, mask_n = offs_p < headdim, offs_n < dstate
    slot = tl.load(state_indices_ptr + seq).to(tl.int64)
    is_cached = slot >= 0
    state_ptrs = (ssm_state_ptr + tl.maximum(slot, 0) * stride_s_slot + head * stride_s_h
                  + offs_p[:, None] * stride_s_p + offs_n[None, :] * stride_s_n)  # fmt: skip
    state_mask = tl.where(is_cached, mask_p[:, None] & mask_n[None, :], False)
    state = tl.load(state_ptrs, mask=state_mask, other=0.0).to(tl.float32)  # (P, N)

    x = tl.load(x_ptr + seq * stride_x_s + head * stride_x_h + offs_p * stride_x_p,
                mask=mask_p, other=0.0).to(tl.float32)  # fmt: skip
    dt_bias = tl.load(dt_bias_ptr + head).to(tl.float32) if HAS_DT_BIAS else 0.0
    dt = discretize_dt(tl.load(dt_ptr + seq * stride_dt_s + head * stride_dt_h), dt_bias,
                       dt_min, dt_max)  # fmt: skip
    A = tl.load(A_ptr + head).to(tl.float32)
    B = tl.load(B_ptr + seq * stride_B_s + group * stride_B_g + offs_n * stride_B_n,
                mask=mask_n, other=0.0).to(tl.float32)  # fmt: skip
    C = tl.load(C_ptr + seq * stride_C_s + group * stride_C_g + offs_n * stride_C_n,
                mask=mask_n, other=0.0).to(tl.float32)  # fmt: skip

    state = state * tl.exp(dt * A) + (dt * x)[:, None] * B[None, :]
    y = tl.sum(state * C[None, :], axis=1)  # (BLOCK_P,)
    if HAS_D:
        y += tl.load(D_ptr + head).to(tl.float32) * x
    tl.store(state_ptrs, state.to(ssm_state_ptr.dtype.element_ty), mask=state_mask)
    y_ptrs = y_ptr + seq * stride_y_s + head * stride_y_h + offs_p * stride_y_p
    tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=mask_p)


def selective_state_update(
    ssm_state: torch.Tensor,  # (num_slots, nheads, headdim, dstate), mutated
    x: torch.Tensor,  # (S, nheads, headdim)
    dt: torch.Tensor,  # (S, nheads), before softplus
    A: torch.Tensor,  # (nheads,), already -exp(A_log)
    B: torch.Tensor,  # (S, ngroups, dstate)
    C: torch.Tensor,  # (S, ngroups, dstate)
    D: torch.Tensor | None,  # (nheads,)
    dt_bias: torch.Tensor | None,  # (nheads,)
    state_indices: torch.Tensor,  # (S,) int32
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    out: torch.Tensor | None = None,  # (S, nheads, headdim), written in place when given
) -> torch.Tensor:
    """One SSM step per row from ``ssm_state[state_indices[s]]``; returns y (S, nheads, headdim)."""
    num_seqs, num_heads, head_dim = x.shape
    dstate = B.shape[2]
    y = out if out is not None else torch.empty_like(x, memory_format=torch.contiguous_format)
    if num_seqs == 0:
        return y
    block_p = min(triton.next_power_of_2(head_dim), _MAX_BLOCK_HEADDIM)
    grid = (num_seqs, num_heads, triton.cdiv(head_dim, block_p))
    launch(_selective_state_update_kernel, grid,
        ssm_state, x, dt, A, B, C, D if D is not None else A,
        dt_bias if dt_bias is not None else A, y,
        state_indices, head_dim, dstate, num_heads // B.shape[1],
        float(dt_limit[0]), float(dt_limit[1]),
        *ssm_state.stride(), *x.stride(), *dt.stride(), *B.stride(), *C.stride(), *y.stride(),
        HAS_D=D is not None, HAS_DT_BIAS=dt_bias is not None,
        BLOCK_P=block_p, BLOCK_N=triton.next_power_of_2(dstate),
    )  # fmt: skip
    return y
