"""The gated delta rule over state slots in torch: the native implementations of the ops
``chunk_gated_delta_rule`` (packed prefill sequences) and ``recurrent_gated_delta_rule`` (decode
rows), the CPU path and the oracle of the other implementations (``registration.py``).

Every implementation of these two ops takes the same operands and keeps the same invariants:

- ``q``, ``k``: ``(B, L, Hk, Dk)``; ``v``: ``(B, L, Hv, Dv)``; ``g`` (log decay, float32) and
  ``beta``: ``(B, L, Hv)``, as the mixer's causal conv and gate left them (q and k not yet
  L2-normalised: the implementation normalises them and scales q by ``Dk ** -0.5``);
- ``state``: the layer's recurrent states ``(num_slots, Hv, Dk, Dv)``, read at the sequences'
  slots and written back there in place; the returned output is ``v``'s shape in ``q``'s dtype.

``chunk_gated_delta_rule_varlen`` takes ``B == 1`` packed sequences bounded by ``cu_seqlens``
``(N + 1,)``: sequence ``n`` starts from ``state[state_indices[n]]`` where
``has_initial_state[n]``, else from zeros, and its final state goes back to that slot (a slot
below zero is none: zeros in, nothing written). It may synchronise with the host (it runs
outside captured graphs). ``recurrent_gated_delta_rule_slots`` takes ``B`` decode rows of ``L``
tokens each (``L == 1`` now; several for speculative decoding), row ``b`` continuing from
``state[state_indices[b]]`` (padded rows point at the null slot 0); it never synchronises with
the host, so a FULL decode graph can hold it.
"""

from __future__ import annotations

import torch

from pieceworks.kernels.gated_delta_rule.torch_gated_delta_rule import (
    chunk_gated_delta_rule,
    recurrent_gated_delta_rule,
)


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
    """The chunked form per packed sequence (a host loop; see the module docstring)."""
    out = torch.zeros(v.shape, dtype=q.dtype, device=q.device)  # (1, T, Hv, Dv)
    bounds = cu_seqlens.tolist()
    for seq_idx, (first, last) in enumerate(zip(bounds[:-1], bounds[1:])):
        if last == first:
            continue  # a padded sequence: no tokens, no state
        slot = int(state_indices[seq_idx])
        starts_from_slot = slot >= 0 and bool(has_initial_state[seq_idx])
        initial_state = state[slot : slot + 1] if starts_from_slot else None
        tokens = slice(first, last)
        seq_out, final_state = chunk_gated_delta_rule(
            q[:, tokens], k[:, tokens], v[:, tokens], g[:, tokens], beta[:, tokens], initial_state
        )
        out[:, tokens] = seq_out
        if slot >= 0:
            state[slot] = final_state[0].to(state.dtype)
    return out


def recurrent_gated_delta_rule_slots(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    state_indices: torch.Tensor,
) -> torch.Tensor:
    """The recurrent form per decode row: gather the slots' states, step, scatter them back."""
    slots = state_indices.long()
    out, final_state = recurrent_gated_delta_rule(q, k, v, g, beta, state[slots])
    state.index_copy_(0, slots, final_state.to(state.dtype))
    return out
