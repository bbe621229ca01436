"""The gated delta rule over state slots with flash-linear-attention's Triton kernels (the
``fla-core`` package, pieceworks' optional ``fla`` extra): ``chunk_gated_delta_rule`` for
packed prefill sequences and ``fused_recurrent_gated_delta_rule`` for decode rows.

Operands, layout and invariants are those of the torch forms (``torch_state_slots.py``), which
these equal up to rounding. The conventions line up as follows: fla's ``g`` is the same log decay
(``S_t = exp(g_t) S_{t-1}``, per value head), its ``beta`` the same rate after the sigmoid (the
in-kernel sigmoid and gate stay off), ``use_qk_l2norm_in_kernel`` normalises q and k as
``x / sqrt(sum(x**2) + 1e-6)`` before q is scaled, ``scale`` is ``Dk ** -0.5``, value head ``h``
reads key head ``h // (Hv / Hk)`` (the torch forms' ``repeat_interleave``), and states are
``(N, Hv, Dk, Dv)`` float32 (``state_v_first`` off). fla's kernels take one initial state per
sequence, not slot indices, so both functions gather the slots' states and scatter the final
ones back with ``index_copy_``; the causal conv and its state stay with the mixer.

Host synchronisation: ``fused_recurrent_gated_delta_rule`` has none (no ``.item()``,
``.tolist()`` or data-dependent shape on its path; one Triton kernel without autotuning, its
output and final state allocated per call), so the decode rows run inside FULL decode graphs.
``chunk_gated_delta_rule`` with ``cu_seqlens`` synchronises (``prepare_chunk_indices`` reads the
chunk counts on the host via ``repeat_interleave``) and autotunes its kernels on first use; it
runs only for prefill and mixed steps, which the op's split keeps outside captured graphs. Its
``tensor_cache`` memoises per ``cu_seqlens`` object, so each call passes a freshly computed one.

fla is imported on the first call, not with this module: the registry names these functions
without importing the library, and its ``Supports`` says whether it is installed.
"""

from __future__ import annotations

import torch


def chunk_gated_delta_rule_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    cu_seqlens: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
) -> torch.Tensor:
    """fla's chunked kernels over the packed sequences, states from and to their slots."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    num_tokens = q.shape[1]
    # padded sequences (length 0) may start past the step's tokens: clamp them onto its end
    cu_seqlens = cu_seqlens.clamp(max=num_tokens).long()
    slots = state_indices.long()
    from_slot = (has_initial_state & (slots >= 0))[:, None, None, None]
    slots = slots.clamp(min=0)  # a slot below zero reads zeros and writes the null slot 0
    initial_state = torch.where(from_slot, state[slots], 0.0).float()  # (N, Hv, Dk, Dv)
    out, final_state = chunk_gated_delta_rule(
        q, k, v, g=g, beta=beta, scale=q.shape[-1] ** -0.5, initial_state=initial_state,
        output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens,
    )  # fmt: skip
    state.index_copy_(0, slots, final_state.to(state.dtype))
    return out.to(q.dtype)


def recurrent_gated_delta_rule_slots(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    state_indices: torch.Tensor,
) -> torch.Tensor:
    """fla's fused recurrent kernel over the decode rows, states from and to their slots."""
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

    slots = state_indices.long()
    # keywords throughout: fla's positional order is (q, k, v, g, gk, gv, beta, ...)
    out, final_state = fused_recurrent_gated_delta_rule(
        q, k, v, g=g, beta=beta, scale=q.shape[-1] ** -0.5, initial_state=state[slots],
        output_final_state=True, use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    state.index_copy_(0, slots, final_state.to(state.dtype))
    return out.to(q.dtype)
