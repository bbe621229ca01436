"""Float32 torch references for the Mamba2 mixer core: causal conv1d, SSM scan, gated RMS norm.

These are the semantics the Triton kernels in this package must reproduce, written as plainly as
possible (a Python loop over sequences, and over tokens for the scan) so that a reader can check
them against HF transformers' ``BambaMixer`` line by line. They own nothing else: no dispatch, no
speed. Tests and CPU fallbacks use them; the model never calls them on a GPU hot path.

Packed ragged batch conventions shared by every op in ``pieceworks.models.mamba.ops``:

- tokens of ``S`` sequences are packed along ``T``; sequence ``s`` is
  ``[query_start_loc[s], query_start_loc[s + 1])``;
- ``state_indices[s]`` is the cache slot of sequence ``s``; a negative slot means "no cache": the
  sequence starts from zeros and its final state is dropped;
- ``has_initial_state[s]`` says whether to start from the stored state (a continued chunked
  prefill) or from zeros;
- a sequence of length 0 (padding) reads and writes no state at all.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _sequence_bounds(query_start_loc: torch.Tensor) -> list[tuple[int, int]]:
    bounds = query_start_loc.tolist()
    return list(zip(bounds[:-1], bounds[1:]))


def _starts_from_cache(slot: int, has_initial_state: torch.Tensor, seq_idx: int) -> bool:
    return slot >= 0 and bool(has_initial_state[seq_idx])


def causal_conv1d_ref(
    xBC: torch.Tensor,  # (T, conv_dim)
    conv_weight: torch.Tensor,  # (conv_dim, d_conv)
    conv_bias: torch.Tensor | None,  # (conv_dim,)
    conv_state: torch.Tensor,  # (num_slots, conv_dim, d_conv - 1), mutated
    query_start_loc: torch.Tensor,  # (S + 1,) int32
    state_indices: torch.Tensor,  # (S,) int32
    has_initial_state: torch.Tensor,  # (S,) bool
) -> torch.Tensor:
    """Depthwise causal conv1d + SiLU per sequence; leaves each one's last inputs in its slot."""
    conv_dim, width = conv_weight.shape
    out = torch.empty_like(xBC)
    weight = conv_weight.float().unsqueeze(1)  # (conv_dim, 1, d_conv)
    bias = None if conv_bias is None else conv_bias.float()
    for seq_idx, (start, end) in enumerate(_sequence_bounds(query_start_loc)):
        if end == start:
            continue
        slot = int(state_indices[seq_idx])
        history = torch.zeros(conv_dim, width - 1, dtype=torch.float32, device=xBC.device)
        if _starts_from_cache(slot, has_initial_state, seq_idx):
            history = conv_state[slot].float()
        window = torch.cat([history, xBC[start:end].float().t()], dim=1)  # (conv_dim, d_conv-1+L)
        conv = F.conv1d(window.unsqueeze(0), weight, bias, groups=conv_dim)[0]  # (conv_dim, L)
        out[start:end] = F.silu(conv).t().to(out.dtype)
        if slot >= 0:
            conv_state[slot] = window[:, window.shape[1] - (width - 1) :].to(conv_state.dtype)
    return out


def _discretize_dt(
    dt: torch.Tensor,
    dt_bias: torch.Tensor | None,
    dt_limit: tuple[float, float],
) -> torch.Tensor:
    """``clamp(softplus(dt + dt_bias), *dt_limit)`` in float32."""
    dt = dt.float()
    if dt_bias is not None:
        dt = dt + dt_bias.float()
    return F.softplus(dt).clamp(min=dt_limit[0], max=dt_limit[1])


def ssm_scan_ref(
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
) -> torch.Tensor:
    """Sequential selective scan, one token at a time; leaves each final state in its slot."""
    num_heads, head_dim = x.shape[1], x.shape[2]
    heads_per_group = num_heads // B.shape[1]
    y = torch.empty_like(x)
    dt = _discretize_dt(dt, dt_bias, dt_limit)  # (T, nheads)
    A, Bh, Ch = A.float(), _expand_groups(B, heads_per_group), _expand_groups(C, heads_per_group)
    for seq_idx, (start, end) in enumerate(_sequence_bounds(query_start_loc)):
        if end == start:
            continue
        slot = int(state_indices[seq_idx])
        state = torch.zeros(num_heads, head_dim, B.shape[2], dtype=torch.float32, device=x.device)
        if _starts_from_cache(slot, has_initial_state, seq_idx):
            state = ssm_state[slot].float()
        for t in range(start, end):
            decay = torch.exp(dt[t] * A)[:, None, None]  # (nheads, 1, 1)
            update = (dt[t, :, None] * x[t].float())[:, :, None] * Bh[t][:, None, :]
            state = state * decay + update  # (nheads, headdim, dstate)
            y_t = torch.einsum("hpn,hn->hp", state, Ch[t])
            if D is not None:
                y_t = y_t + D.float()[:, None] * x[t].float()
            y[t] = y_t.to(y.dtype)
        if slot >= 0:
            ssm_state[slot] = state.to(ssm_state.dtype)
    return y


def _expand_groups(BC: torch.Tensor, heads_per_group: int) -> torch.Tensor:
    """(T, ngroups, dstate) -> (T, nheads, dstate) float32; head h reads group h // per_group."""
    return BC.float().repeat_interleave(heads_per_group, dim=1)


def gated_rms_norm_ref(
    y: torch.Tensor,  # (..., intermediate)
    gate: torch.Tensor,  # (..., intermediate)
    weight: torch.Tensor,  # (intermediate,)
    eps: float,
    n_groups: int,
) -> torch.Tensor:
    """``weight * rmsnorm(y * silu(gate))`` with the RMS taken within each of n_groups chunks.

    Matches HF's ``BambaRMSNormGated`` (gate applied before the norm, statistics in float32,
    cast back to ``y.dtype`` before the weight multiply).
    """
    hidden = y.float() * F.silu(gate.float())
    *prefix, hidden_size = hidden.shape
    grouped = hidden.view(*prefix, n_groups, hidden_size // n_groups)
    variance = grouped.pow(2).mean(-1, keepdim=True)
    normed = (grouped * torch.rsqrt(variance + eps)).view(*prefix, hidden_size)
    return weight * normed.to(y.dtype)
