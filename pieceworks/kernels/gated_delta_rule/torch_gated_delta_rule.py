"""The gated delta rule in torch: chunked (prefill) and recurrent (decode), in float32.

Per value head, with state ``S (Dk, Dv)``, decay ``g_t <= 0`` (log space) and rate ``beta_t``::

    S_t = exp(g_t) * S_{t-1}
    S_t = S_t + k_t (beta_t * (v_t - S_t^T k_t))^T      # the delta rule: write the correction
    o_t = S_t^T q_t                                      # q_t scaled by Dk ** -0.5

with ``q`` and ``k`` L2-normalised first when ``use_qk_l2norm`` (Qwen3.5 always). Query/key heads
are shared by ``Hv / Hk`` consecutive value heads. ``chunk_gated_delta_rule`` computes the same
thing a chunk of ``chunk_size`` tokens at a time (the UT transform of the DeltaNet paper: a
triangular solve per chunk, then one state update per chunk); ``recurrent_gated_delta_rule`` one
token at a time, with no host synchronisation (capturable in a static graph). Both follow
transformers' ``torch_chunk_gated_delta_rule`` / ``torch_recurrent_gated_delta_rule`` line by line
(Qwen3.5's modeling file), and take and return the layout of flash-linear-attention's
``chunk_gated_delta_rule`` / ``fused_recurrent_gated_delta_rule``:

- ``q``, ``k``: ``(B, L, Hk, Dk)``; ``v``: ``(B, L, Hv, Dv)``; ``g``, ``beta``: ``(B, L, Hv)``;
- ``initial_state``: ``(B, Hv, Dk, Dv)`` or None (zeros);
- returns ``o (B, L, Hv, Dv)`` in ``q``'s dtype and the final state ``(B, Hv, Dk, Dv)`` float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

DEFAULT_CHUNK_SIZE = 64  # transformers' and flash-linear-attention's


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x**2) + eps)`` over the last dim (flash-linear-attention's form)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _prepare(q, k, v, g, beta, use_qk_l2norm: bool):
    """Heads shared, everything float32 ``(B, H, L, ...)``, q and k normalised, q scaled."""
    num_k_heads, num_v_heads = k.shape[2], v.shape[2]
    if num_k_heads != num_v_heads:
        q = q.repeat_interleave(num_v_heads // num_k_heads, dim=2)
        k = k.repeat_interleave(num_v_heads // num_k_heads, dim=2)
    q, k, v, beta, g = (
        x.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format)
        for x in (q, k, v, beta, g)
    )
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    return q * q.shape[-1] ** -0.5, k, v, g, beta


def _initial(initial_state, batch, heads, k_dim, v_dim, like):
    if initial_state is None:
        return torch.zeros(batch, heads, k_dim, v_dim, dtype=torch.float32, device=like.device)
    return initial_state.to(torch.float32)


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    use_qk_l2norm: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token at a time (decode: ``L == 1``); see the module docstring for the layout."""
    out_dtype = q.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta, use_qk_l2norm)
    batch, heads, length, k_dim = k.shape
    state = _initial(initial_state, batch, heads, k_dim, v.shape[-1], v)
    out = torch.empty_like(v)  # (B, H, L, Dv)
    for t in range(length):
        state = state * g[:, :, t].exp()[..., None, None]
        kv_mem = (state * k[:, :, t, :, None]).sum(dim=-2)  # (B, H, Dv): S^T k
        delta = (v[:, :, t] - kv_mem) * beta[:, :, t, None]
        state = state + k[:, :, t, :, None] * delta[:, :, None, :]
        out[:, :, t] = (state * q[:, :, t, :, None]).sum(dim=-2)
    return out.transpose(1, 2).contiguous().to(out_dtype), state


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    use_qk_l2norm: bool = True,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``chunk_size`` tokens at a time (prefill); see the module docstring for the layout."""
    out_dtype, length = q.dtype, q.shape[1]
    q, k, v, g, beta = _prepare(q, k, v, g, beta, use_qk_l2norm)
    batch, heads, _, k_dim = k.shape
    pad = (chunk_size - length % chunk_size) % chunk_size
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    beta, g = (F.pad(x, (0, pad)) for x in (beta, g))
    v_beta, k_beta = v * beta[..., None], k * beta[..., None]
    q, k, k_beta, v_beta = (
        x.reshape(batch, heads, -1, chunk_size, x.shape[-1]) for x in (q, k, k_beta, v_beta)
    )  # (B, H, num_chunks, C, D)
    cum_decay = g.reshape(batch, heads, -1, chunk_size).cumsum(dim=-1)  # (B, H, N, C)
    upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).triu(1)
    pairwise_decay = (
        (cum_decay[..., :, None] - cum_decay[..., None, :]).masked_fill(upper, float("-inf")).exp()
    )  # (B, H, N, C, C): decay from token j to token i of a chunk, j <= i
    ut_system = (k_beta @ k.transpose(-1, -2)) * pairwise_decay
    intra_chunk_attn = (q @ k.transpose(-1, -2)) * pairwise_decay
    decayed_k_beta = k_beta * cum_decay.exp()[..., None]
    solve = torch.linalg.solve_triangular
    new_values = solve(ut_system, v_beta, upper=False, unitriangular=True)
    k_cumdecay = solve(ut_system, decayed_k_beta, upper=False, unitriangular=True)
    state = _initial(initial_state, batch, heads, k_dim, v.shape[-1], v)
    out = torch.zeros_like(new_values)  # (B, H, N, C, Dv)
    q = q * cum_decay.exp()[..., None]
    k = k * (cum_decay[..., -1:] - cum_decay).exp()[..., None]
    chunk_decay = cum_decay[..., -1].exp()[..., None, None]  # (B, H, N, 1, 1)
    for i in range(q.shape[2]):
        v_new = new_values[:, :, i] - k_cumdecay[:, :, i] @ state
        out[:, :, i] = q[:, :, i] @ state + intra_chunk_attn[:, :, i] @ v_new
        state = state * chunk_decay[:, :, i] + k[:, :, i].transpose(-1, -2) @ v_new
    out = out.reshape(batch, heads, -1, v.shape[-1])[:, :, :length]
    return out.transpose(1, 2).contiguous().to(out_dtype), state
