"""The gated delta-rule mixer core over the state slots: causal conv, then the delta rule.

``GatedDeltaNetBackend.forward`` owns the split Mamba's backends share (``mamba/backends.py``):
the step's leading ``metadata.num_decodes`` sequences (one token each, continuing from their
slot) take the single-step path, written without a host synchronisation so that a FULL decode
graph can hold it (one conv step, the ``causal_conv1d_update`` op, then the
``recurrent_gated_delta_rule`` op over the slots; padded rows go to the null slot 0); the other
sequences (prefills and continued chunked prefills, ``has_initial_state`` saying which) take the
varlen path: the packed causal conv (the ``causal_conv1d_varlen`` op: depthwise, SiLU, the last
``d_conv - 1`` inputs left in the slot), then the ``chunk_gated_delta_rule`` op over the packed
sequences, each from its slot's state (or zeros), its final state written back. Which
implementation each op runs (the torch forms here and in ``mamba/ops``, the Mamba2 Triton conv
kernels, flash-linear-attention's delta-rule kernels) the engine's kernel chooser decides when
the model is built (``GatedDeltaNet.choose_kernels``, ``docs/kernels.md``); the params carry it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.nn.functional as F

from pieceworks.kernels.gated_delta_rule import torch_state_slots
from pieceworks.models.attention.metadata import AttentionMetadata
from pieceworks.models.mamba.ops import causal_conv1d_ref


def conv_update_torch(
    x: torch.Tensor,  # (S, conv_dim), one new token per sequence
    conv_state: torch.Tensor,  # (num_slots, conv_dim, d_conv - 1), mutated
    weight: torch.Tensor,  # (conv_dim, d_conv)
    bias: torch.Tensor | None,  # (conv_dim,)
    state_indices: torch.Tensor,  # (S,)
) -> torch.Tensor:
    """One decode step of the conv + SiLU in torch (no host sync); ``x[s]`` shifted into its
    slot. The torch form of the ``causal_conv1d_update`` op; returns (S, conv_dim), x.dtype."""
    slots = state_indices.long()
    window = torch.cat([conv_state[slots], x[:, :, None].to(conv_state.dtype)], dim=-1)
    conv_state.index_copy_(0, slots, window[:, :, 1:])
    conv = (window.float() * weight.float()).sum(dim=-1)  # (S, conv_dim)
    if bias is not None:
        conv = conv + bias.float()
    return F.silu(conv).to(x.dtype)


@dataclasses.dataclass(frozen=True)
class GatedDeltaNetParams:
    """One layer's conv weights, head layout and delta-rule implementations (what the core
    needs besides the step)."""

    conv_weight: torch.Tensor  # (conv_dim, d_conv)
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    chunk_kernel: Callable[..., torch.Tensor] = torch_state_slots.chunk_gated_delta_rule_varlen
    recurrent_kernel: Callable[..., torch.Tensor] = (
        torch_state_slots.recurrent_gated_delta_rule_slots
    )
    conv_update_kernel: Callable[..., torch.Tensor] = conv_update_torch
    conv_varlen_kernel: Callable[..., torch.Tensor] = causal_conv1d_ref

    def split_qkv(self, conv_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(T, conv_dim)`` -> q, k ``(1, T, Hk, Dk)`` and v ``(1, T, Hv, Dv)`` (views)."""
        num_tokens, key_dim = conv_out.shape[0], self.num_k_heads * self.head_k_dim
        q, k, v = conv_out.split([key_dim, key_dim, self.num_v_heads * self.head_v_dim], dim=-1)
        key_shape = (1, num_tokens, self.num_k_heads, self.head_k_dim)
        value_shape = (1, num_tokens, self.num_v_heads, self.head_v_dim)
        return q.view(key_shape), k.view(key_shape), v.view(value_shape)


class GatedDeltaNetBackend:
    """The conv and the delta rule as chosen; the decode half is capturable in a FULL graph with
    any of the implementations."""

    name = "torch"

    @classmethod
    def forward(
        cls,
        mixed_qkv: torch.Tensor,  # (T, conv_dim): [q, k, v] before the conv
        g: torch.Tensor,  # (T, Hv) float32, log decay
        beta: torch.Tensor,  # (T, Hv)
        output: torch.Tensor,  # (T, Hv * Dv), written in place
        cache: tuple[torch.Tensor, torch.Tensor],  # conv (slots, conv_dim, d_conv - 1), state
        params: GatedDeltaNetParams,
        metadata: AttentionMetadata,
    ) -> None:
        if metadata.num_decodes > 0:
            cls._decode(mixed_qkv, g, beta, output, cache, params, metadata)
        # a FULL decode graph pads the batch with sequences of no tokens: nothing to prefill
        if metadata.num_actual_tokens > metadata.num_decodes:
            cls._prefill(mixed_qkv, g, beta, output, cache, params, metadata)

    @staticmethod
    def _decode(mixed_qkv, g, beta, output, cache, params, metadata) -> None:
        """Sequence i < num_decodes is token i: one conv step and one delta-rule step each."""
        conv_state, recurrent_state = cache
        num_decodes = metadata.num_decodes
        slots = metadata.state_indices[:num_decodes].long()
        conv_out = params.conv_update_kernel(
            mixed_qkv[:num_decodes], conv_state, params.conv_weight, None, slots
        )  # (S, conv_dim)
        q, k, v = (t.transpose(0, 1) for t in params.split_qkv(conv_out))  # (S, 1, H, D)
        out = params.recurrent_kernel(
            q, k, v, g[:num_decodes, None], beta[:num_decodes, None], recurrent_state, slots
        )  # (S, 1, Hv, Dv); the slots' states stepped in place
        output[:num_decodes] = out.reshape(num_decodes, -1)

    @staticmethod
    def _prefill(mixed_qkv, g, beta, output, cache, params, metadata) -> None:
        """Sequences from num_decodes on, over their tokens [num_decodes, num_actual_tokens)."""
        conv_state, recurrent_state = cache
        start, end = metadata.num_decodes, metadata.num_actual_tokens
        query_start_loc = metadata.query_start_loc[start:] - start
        slots = metadata.state_indices[start:]
        has_initial_state = metadata.has_initial_state[start:]
        conv_out = params.conv_varlen_kernel(
            mixed_qkv[start:end], params.conv_weight, None, conv_state,
            query_start_loc, slots, has_initial_state,
        )  # fmt: skip
        q, k, v = params.split_qkv(conv_out)  # (1, T, H, D)
        out = params.chunk_kernel(
            q, k, v, g[None, start:end], beta[None, start:end], recurrent_state,
            query_start_loc, slots, has_initial_state,
        )  # fmt: skip
        output[start:end] = out[0].reshape(end - start, -1)
