"""Mamba2 backends: the kernels a platform picks for the mixer core, behind one ``forward``.

``current_platform().mamba_backend()`` returns one of these classes (by qualname). The mixer op
calls ``forward``, which owns the split every backend shares: the step's leading
``metadata.num_decodes`` sequences (one token each, continuing from their saved state) go through
the single-step kernels (``conv_update`` + ``state_update``), graph-capturable; the other
sequences (prefills, chunked prefills continuing from their state, padded sequences of length 0)
go through the varlen kernels (``conv_varlen`` + ``scan_varlen``). A backend only supplies those
four kernels; each writes into the ``out`` it is given. Token rows past
``metadata.num_actual_tokens`` belong to no sequence: nothing reads them.
"""

from __future__ import annotations

import dataclasses

import torch

from pieceworks.models.attention.metadata import AttentionMetadata
from pieceworks.models.mamba.ops import (
    causal_conv1d_ref,
    causal_conv1d_update,
    causal_conv1d_varlen,
    mamba_chunk_scan_varlen,
    selective_state_update,
    ssm_scan_ref,
)


@dataclasses.dataclass(frozen=True)
class Mamba2Params:
    """One mixer layer's core weights and head layout (what the kernels need besides the step)."""

    conv_weight: torch.Tensor  # (conv_dim, d_conv)
    conv_bias: torch.Tensor | None  # (conv_dim,)
    A: torch.Tensor  # (nheads,) float32, -exp(A_log)
    D: torch.Tensor  # (nheads,)
    dt_bias: torch.Tensor  # (nheads,)
    num_heads: int
    head_dim: int
    num_groups: int
    state_size: int
    dt_limit: tuple[float, float]

    def split_conv_output(
        self, conv_out: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(T, conv_dim)`` -> x ``(T, H, P)``, B and C ``(T, G, N)`` (views, no copy)."""
        num_tokens = conv_out.shape[0]
        intermediate = self.num_heads * self.head_dim
        group_width = self.num_groups * self.state_size
        x = conv_out[:, :intermediate].view(num_tokens, self.num_heads, self.head_dim)
        B = conv_out[:, intermediate : intermediate + group_width]
        C = conv_out[:, intermediate + group_width :]
        shape = (num_tokens, self.num_groups, self.state_size)
        return x, B.view(shape), C.view(shape)


class MambaBackend:
    """Interface (four kernels) plus the decode / prefill split every backend runs."""

    name = "base"

    @classmethod
    def forward(
        cls,
        xBC: torch.Tensor,  # (T, conv_dim), may be a column slice of the in_proj output
        dt: torch.Tensor,  # (T, nheads), before softplus
        output: torch.Tensor,  # (T, nheads * headdim), written in place
        mamba_cache: tuple[torch.Tensor, torch.Tensor],  # (conv_state, ssm_state)
        params: Mamba2Params,
        metadata: AttentionMetadata,
    ) -> None:
        """Conv + SSM of one step over the layer's state cache; y goes into ``output``."""
        num_tokens, conv_dim = xBC.shape
        conv_out = torch.empty((num_tokens, conv_dim), dtype=xBC.dtype, device=xBC.device)
        y = output.view(num_tokens, params.num_heads, params.head_dim)
        num_decodes = metadata.num_decodes
        if num_decodes > 0:
            cls._decode(xBC, dt, conv_out, y, mamba_cache, params, metadata)
        if metadata.num_seqs > num_decodes:
            cls._prefill(xBC, dt, conv_out, y, mamba_cache, params, metadata)

    @classmethod
    def _decode(cls, xBC, dt, conv_out, y, mamba_cache, params, metadata) -> None:
        """Sequence i < num_decodes is token i: one single-step update per sequence."""
        conv_state, ssm_state = mamba_cache
        num_decodes = metadata.num_decodes
        slots = metadata.state_indices[:num_decodes]
        conv_out = conv_out[:num_decodes]
        cls.conv_update(
            xBC[:num_decodes], conv_state, params.conv_weight, params.conv_bias, slots, conv_out
        )
        x, B, C = params.split_conv_output(conv_out)
        cls.state_update(ssm_state, x, dt[:num_decodes], B, C, slots, params, y[:num_decodes])

    @classmethod
    def _prefill(cls, xBC, dt, conv_out, y, mamba_cache, params, metadata) -> None:
        """Sequences from num_decodes on, over their tokens [num_decodes, num_actual_tokens)."""
        conv_state, ssm_state = mamba_cache
        start, end = metadata.num_decodes, metadata.num_actual_tokens
        query_start_loc = metadata.query_start_loc[start:] - start  # device op, no sync
        slots = metadata.state_indices[start:]
        has_initial_state = metadata.has_initial_state[start:]
        seqs = (query_start_loc, slots, has_initial_state)
        conv_out = conv_out[start:end]
        cls.conv_varlen(
            xBC[start:end], params.conv_weight, params.conv_bias, conv_state, *seqs, conv_out
        )
        x, B, C = params.split_conv_output(conv_out)
        cls.scan_varlen(x, dt[start:end], B, C, ssm_state, *seqs, params, y[start:end])

    # --- the four kernels a backend supplies -------------------------------------------------
    @staticmethod
    def conv_update(x, conv_state, weight, bias, state_indices, out) -> None:
        """Conv1d + SiLU of one token per row, shifting it into ``conv_state[state_indices]``."""
        raise NotImplementedError

    @staticmethod
    def state_update(ssm_state, x, dt, B, C, state_indices, params, out) -> None:
        """One SSM step per row from ``ssm_state[state_indices]``, updated in place."""
        raise NotImplementedError

    @staticmethod
    def conv_varlen(
        xBC, weight, bias, conv_state, query_start_loc, state_indices, has_initial_state, out
    ) -> None:
        """Causal conv1d + SiLU over packed sequences, continuing where ``has_initial_state``."""
        raise NotImplementedError

    @staticmethod
    def scan_varlen(
        x, dt, B, C, ssm_state, query_start_loc, state_indices, has_initial_state, params, out
    ) -> None:
        """Selective scan over packed sequences, leaving each final state in its slot."""
        raise NotImplementedError


def _single_token_sequences(state_indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``query_start_loc`` and ``has_initial_state`` of S length-1 sequences that all continue."""
    num_seqs = state_indices.shape[0]
    query_start_loc = torch.arange(num_seqs + 1, dtype=torch.int32, device=state_indices.device)
    return query_start_loc, torch.ones_like(state_indices, dtype=torch.bool)


class TorchMambaBackend(MambaBackend):
    """The float32 torch references (CPU, and the oracle in tests); not graph-capturable."""

    name = "torch"

    @staticmethod
    def conv_update(x, conv_state, weight, bias, state_indices, out) -> None:
        seqs = _single_token_sequences(state_indices)
        out.copy_(causal_conv1d_ref(x, weight, bias, conv_state, seqs[0], state_indices, seqs[1]))

    @staticmethod
    def state_update(ssm_state, x, dt, B, C, state_indices, params, out) -> None:
        query_start_loc, has_initial_state = _single_token_sequences(state_indices)
        TorchMambaBackend.scan_varlen(
            x, dt, B, C, ssm_state, query_start_loc, state_indices, has_initial_state, params, out
        )

    @staticmethod
    def conv_varlen(
        xBC, weight, bias, conv_state, query_start_loc, state_indices, has_initial_state, out
    ) -> None:
        out.copy_(
            causal_conv1d_ref(
                xBC, weight, bias, conv_state, query_start_loc, state_indices, has_initial_state
            )
        )

    @staticmethod
    def scan_varlen(
        x, dt, B, C, ssm_state, query_start_loc, state_indices, has_initial_state, params, out
    ) -> None:
        y = ssm_scan_ref(
            x, dt, params.A, B, C, params.D, params.dt_bias, ssm_state,
            query_start_loc, state_indices, has_initial_state, params.dt_limit,
        )  # fmt: skip
        out.copy_(y)


class TritonMambaBackend(MambaBackend):
    """Triton kernels (CUDA and ROCm); the decode half is capturable in a FULL graph."""

    name = "triton"

    @staticmethod
    def conv_update(x, conv_state, weight, bias, state_indices, out) -> None:
        causal_conv1d_update(x, conv_state, weight, bias, state_indices, out=out)

    @staticmethod
    def state_update(ssm_state, x, dt, B, C, state_indices, params, out) -> None:
        selective_state_update(
            ssm_state, x, dt, params.A, B, C, params.D, params.dt_bias, state_indices,
            params.dt_limit, out=out,
        )  # fmt: skip

    @staticmethod
    def conv_varlen(
        xBC, weight, bias, conv_state, query_start_loc, state_indices, has_initial_state, out
    ) -> None:
        causal_conv1d_varlen(
            xBC, weight, bias, conv_state, query_start_loc, state_indices, has_initial_state, out
        )

    @staticmethod
    def scan_varlen(
        x, dt, B, C, ssm_state, query_start_loc, state_indices, has_initial_state, params, out
    ) -> None:
        mamba_chunk_scan_varlen(
            x, dt, params.A, B, C, params.D, params.dt_bias, ssm_state,
            query_start_loc, state_indices, has_initial_state, params.dt_limit, out=out,
        )  # fmt: skip
